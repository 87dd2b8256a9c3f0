"""`KVCacheResource`: the paged KV cache as a step resource (key ``"kv"``).

Protocol per step:

- ``admit`` reserves whole pages for every segment's span, all at once: either every stream of
  the step gets what it needs or nothing new is taken. Pages a stream already holds from
  earlier steps stay as its high-water mark. Refusals are values, never exceptions.
- ``plan`` builds the step's `KVPlan` from the stored lengths; it changes nothing.
- ``commit`` is the only place lengths advance, then offers newly filled whole pages to the
  prefix index.

One reentrant lock guards stream and arena state; the allocator has its own lock.

Offload and reload to host memory (claim -> copy -> land) are `HostOffload`'s (offload.py);
prefix reuse and indexing are `PrefixSharing`'s (prefix_sharing.py).

On a hybrid model (`KVGroups`) a request has one stream per group. Steps declare the main
stream only; every stage applies a main segment to the request's other groups too (one
all-or-nothing reservation across them), and commit gives a sliding group's pages back once
they leave its window.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv.allocator import PageArena
from mstar.engine.resources.kv.cache import KVCache
from mstar.engine.resources.kv.config import KVConfig, KVRequestConfig, pages_for
from mstar.engine.resources.kv.copier import CopyWorker
from mstar.engine.resources.kv.debug import check_pages_conserved, debug_asserts_enabled
from mstar.engine.resources.kv.grouping import GroupedStreams
from mstar.engine.resources.kv.groups import live_from
from mstar.engine.resources.kv.host import HostPagePool
from mstar.engine.resources.kv.offload import HostOffload
from mstar.engine.resources.kv.plan import KVPlan, build_plan
from mstar.engine.resources.kv.prefix import PrefixIndex
from mstar.engine.resources.kv.prefix_sharing import PrefixSharing
from mstar.engine.resources.kv.stream import MAIN_LABEL, Stream
from mstar.engine.resources.kv.transfer import CopyLedger
from mstar.engine.resources.refusals import RequestRejected
from mstar.engine.resources.step import (
    ADMIT_OK,
    AdmitOutcome,
    AllocationFailed,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
)

__all__ = ["MAIN_LABEL", "KVCacheResource"]

log = logging.getLogger(__name__)


def _refuse(reason: Any) -> AdmitOutcome:
    return AdmitOutcome(False, True, reason)


class KVCacheResource(GroupedStreams, PrefixSharing, HostOffload, Resource):
    """Paged KV cache with a refcounted arena, a prefix index and a host offload tier."""

    supports_eviction = True

    def __init__(self, config: KVConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.cache = KVCache(config)
        self.arena = PageArena(config.num_pages, reserve_sink=config.reserve_sink_page)
        self.prefix: PrefixIndex | None = (
            PrefixIndex(self.arena) if config.enable_prefix_cache else None
        )
        self.host: HostPagePool | None = (
            HostPagePool(self.cache, config.host_offload_pages)
            if config.host_offload_pages > 0
            else None
        )
        self.groups = config.groups
        #: The groups a main segment also covers, with their windows (hybrid models only).
        self._linked = tuple(zip(config.groups.labels, config.groups.windows, strict=True))[1:]
        if self._linked:
            log.info(
                "KV groups: %s (windows %s), %d layers per page",
                ", ".join(config.groups.labels),
                ", ".join(str(w) for w in config.groups.windows),
                config.groups.slots,
            )
        self._streams: dict[str, dict[str, Stream]] = {}
        self._tokens: dict[str, Sequence[int]] = {}
        #: each request's prefix-chain root where it is not the base model's (`cache_salt`)
        self._roots: dict[str, bytes] = {}
        self._lock = threading.RLock()
        self._debug = debug_asserts_enabled()
        self._copies = CopyLedger()
        self._async_copy = config.async_copy
        #: Runs offload/reload copies when ``async_copy``; tests pause/step/resume it.
        self.copier = CopyWorker()
        #: Copies that raised (each was undone: the request stayed where it was).
        self.copy_failures = 0
        #: Prompt tokens looked up / served from the prefix index (vLLM's hit-rate semantics).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # -- stats ---------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Usable device pages (the sink page excluded)."""
        return self.arena.num_usable

    @property
    def num_free_pages(self) -> int:
        return self.arena.num_free

    @property
    def num_cached_pages(self) -> int:
        """Pages only the prefix index holds: kept for reuse, but free to evict on demand."""
        if self.prefix is None:
            return 0
        with self._lock:
            return self.prefix.num_idle()

    @property
    def usage(self) -> float:
        """Fraction of usable pages requests hold (vLLM's meaning: idle cached pages are free)."""
        available = self.arena.num_free + self.num_cached_pages
        return 1.0 - available / self.arena.num_usable

    @property
    def num_host_pages_used(self) -> int:
        return 0 if self.host is None else self.host.num_used

    @property
    def host_usage(self) -> float:
        if self.host is None:
            return 0.0
        return self.host.num_used / self.host.num_pages

    @property
    def num_pages_in_transit(self) -> int:
        """Device pages in-flight copies give back when they land (counted at claim).

        An offload's `reclaimable` pages; for a request removed mid-reload, the pages the
        reload took. Free pages + cached pages + this is what the pool will have.
        """
        return self._copies.num_pages_in_transit

    def copy_in_flight(self, request_id: str) -> bool:
        """An offload or reload of the request has been claimed and has not landed yet."""
        with self._lock:
            return request_id in self._copies

    def wait_copy_progress(self, timeout: float) -> bool:
        """Block until one in-flight copy lands or ``timeout`` passes; at once, answering False,
        when none is in flight. Never call it under the lock."""
        return self.copier.wait_progress(timeout)

    def wait_copies(self, timeout: float | None = None) -> None:
        """Block until every copy has landed (shutdown, tests). Never call it under the lock."""
        self.copier.wait_idle(timeout)

    @property
    def num_prefix_pages(self) -> int:
        return 0 if self.prefix is None else len(self.prefix)

    def pages_held_by(self, request_id: str) -> int:
        """Device pages the request's streams hold (high-water marks included)."""
        with self._lock:
            per = self._streams.get(request_id)
            if per is None:
                return 0
            return sum(len(s.pages) - s.dropped for s in per.values() if s.pages)

    def stored_len(self, request_id: str, label: str = MAIN_LABEL) -> int:
        with self._lock:
            per = self._streams.get(request_id)
            stream = None if per is None else per.get(label)
            return 0 if stream is None else stream.stored_len

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    # -- per request ---------------------------------------------------------------------------
    def ingest_request(self, request_id: str, overrides: Any | None = None) -> None:
        """Open the request's ``"main"`` stream; idempotent (re-ingest keeps the pages)."""
        if overrides is not None and not isinstance(overrides, KVRequestConfig):
            raise TypeError(
                f"KV overrides must be a KVRequestConfig or None, got {type(overrides).__name__}"
            )
        with self._lock:
            self._streams.setdefault(request_id, self._new_streams())
            if overrides is not None:
                self._tokens[request_id] = overrides.token_ids
                if overrides.cache_salt:
                    self._roots[request_id] = overrides.cache_salt

    def remove_request(self, request_id: str) -> None:
        """Free the request's device and host pages (those a copy is moving: once it lands)."""
        with self._lock:
            per = self._streams.pop(request_id, None)
            self._tokens.pop(request_id, None)
            self._roots.pop(request_id, None)
            if per is not None:
                self._drop_streams(request_id, per)
            self._check()

    def reset_request(self, request_id: str, free: bool = False) -> None:
        """Forget the request's cached KV but keep it ingested, token list included.

        ``free=True`` (recompute) gives back every device and host page and leaves one empty
        main stream, so the request can be matched and prefilled again; mid-copy it behaves like
        remove + re-ingest. ``free=False`` (a padding row) keeps private pages as a high-water
        mark and zeroes the lengths, unless a page is shared, on the host or moving, in which
        case it frees like ``free=True``. A step in flight for a reset stream drops its span.
        """
        with self._lock:
            per = self._streams.get(request_id)
            if per is None:
                return
            owners = self.arena.owners
            keep = (
                not free
                and request_id not in self._copies
                and not any(s.offloaded for s in per.values())
                and all(owners[p] == 1 for s in per.values() for p in s.pages)
                and not any(s.dropped for s in per.values())
            )
            if keep:
                for stream in per.values():
                    stream.stored_len = 0
                    stream.keys = []
                    stream.matched = None
                    stream.step_in_flight = False
                    stream.generation += 1
            else:
                self._drop_streams(request_id, per)
                self._streams[request_id] = self._new_streams()
            self._check()

    def _drop_streams(self, request_id: str, per: dict[str, Stream]) -> None:
        """Release the streams' pages; a copy moving some of them releases those on landing."""
        copy = self._copies.detach(request_id)
        moving = () if copy is None else [m.stream for m in copy.moves]
        for stream in per.values():
            if not any(stream is m for m in moving):
                self._drop_stream_storage(stream)

    # -- per step ------------------------------------------------------------------------------
    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve whole pages for each segment's span; all segments or none get new pages."""
        segments = step.segments
        if not segments:
            return ADMIT_OK
        ps = self.page_size
        max_len = self.config.max_seq_len
        usable = self.arena.num_usable
        with self._lock:
            streams = self._streams
            touched: list[Stream] = []
            grow: list[tuple[Stream, int, str, str]] = []
            total = 0
            for rid, label, span in self._expand(segments):
                per = streams.get(rid)
                if per is None:
                    return _refuse(
                        RequestRejected(f"request {rid!r} was never ingested by the KV cache", rid)
                    )
                stream = per.get(label)
                if stream is None:
                    if span <= 0:
                        continue  # a zero-span read of nothing: no stream is created
                    stream = per[label] = Stream()
                if stream.offloaded:  # even a zero-span read needs the pages on the device
                    return _refuse(
                        RequestOffloading(
                            f"request {rid!r} ({label}) is offloaded to host memory; "
                            "retry after reload",
                            label,
                            rid,
                        )
                    )
                if span <= 0:
                    touched.append(stream)
                    continue
                seq = stream.stored_len + span
                if seq > max_len:
                    return _refuse(
                        RequestRejected(
                            f"request {rid!r} needs {seq} tokens of context but the KV cache's "
                            f"max_seq_len is {max_len}; shorten the prompt or max_tokens",
                            rid,
                        )
                    )
                need = pages_for(seq, ps)
                held = len(stream.pages)
                if need > held:
                    if need - stream.dropped > usable:
                        return _refuse(
                            RequestRejected(
                                f"request {rid!r} needs {need} KV pages but the cache has only "
                                f"{usable}; shorten the prompt or max_tokens",
                                rid,
                            )
                        )
                    grow.append((stream, need - held, rid, label))
                    total += need - held
                touched.append(stream)
            if total:
                failed = self._reserve(grow, total)
                if failed is not None:
                    return _refuse(failed)
            for stream in touched:
                stream.step_in_flight = True
            if self._debug:
                self._check()
        return ADMIT_OK

    def _reserve(
        self, grow: list[tuple[Stream, int, str, str]], total: int
    ) -> AllocationFailed | None:
        """Take ``total`` pages in one go and hand them out; evict index leaves when short."""
        arena = self.arena
        pages = arena.acquire(total)
        if pages is None and self.prefix is not None:
            self.prefix.evict(total - arena.num_free)
            pages = arena.acquire(total)
        if pages is None:
            free = arena.num_free
            # Blame the first segment that no longer fits once the ones before it are served.
            running = 0
            rid, label = grow[0][2], grow[0][3]
            for _, n, seg_rid, seg_label in grow:
                running += n
                if running > free:
                    rid, label = seg_rid, seg_label
                    break
            short = total - free
            return AllocationFailed(
                f"KV cache is {short} pages short for request {rid!r} ({label}): the step needs "
                f"{total} new pages and {free} are free",
                short,
                label,
                rid,
            )
        start = 0
        for stream, n, _, _ in grow:
            stream.pages.extend(pages[start : start + n])
            stream.generation += 1
            start += n
        return None

    def plan(self, step: ResourceStep, ctx: StepContext) -> KVPlan:
        segments = step.segments or ()
        ps, device = self.page_size, self.cache.device
        with self._lock:
            main = build_plan(segments, self._streams, ps, device)
            if not self._linked:
                return main
            if any(seg[1] != MAIN_LABEL for seg in segments):
                raise RuntimeError("a hybrid model's KV steps declare main segments only")
            groups = tuple(
                build_plan([Segment(r, g, n) for r, _, n in segments], self._streams, ps, device)
                for g, _ in self._linked
            )
            return main._replace(groups=groups)

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Advance lengths (unless ``step.commit`` is False), then index newly filled pages."""
        segments = step.segments
        if not segments:
            return
        advance = getattr(step, "commit", True)
        index = self.prefix is not None and not ctx.capture
        ps = self.page_size
        windows = dict(self._linked)
        with self._lock:
            streams = self._streams
            for rid, label, span in self._expand(segments):
                per = streams.get(rid)
                stream = None if per is None else per.get(label)
                if stream is None or not stream.step_in_flight:
                    continue  # removed or reset mid-step, or a zero-span read of nothing
                stream.step_in_flight = False
                if not advance or span <= 0:
                    continue
                stored = stream.stored_len = stream.stored_len + span
                stream.generation += 1
                if index and label == MAIN_LABEL and stored // ps > len(stream.keys):
                    self._index_pages(rid, stream)
                window = windows.get(label, 0)
                if window and live_from(stored, window, ps) > stream.dropped:
                    self._slide(stream, live_from(stored, window, ps))
            if self._debug:
                self._check()

    def abort_step(self, step: ResourceStep, ctx: StepContext) -> None:
        """Forward failed: drop the in-flight marks; lengths stay, reserved pages stay held."""
        with self._lock:
            for rid, label, _ in step.segments or ():
                per = self._streams.get(rid)
                stream = None if per is None else per.get(label)
                if stream is not None:
                    stream.step_in_flight = False

    # -- engine --------------------------------------------------------------------------------
    def cleanup(self) -> None:
        self.copier.resume()
        self.wait_copies()
        with self._lock:
            for rid in list(self._streams):
                self.remove_request(rid)
            if self.prefix is not None:
                self.prefix.evict(len(self.prefix))

    # -- debug ---------------------------------------------------------------------------------
    def assert_pages_conserved(self) -> None:
        """Raise AssertionError unless owner counts match references exactly (see debug.py)."""
        with self._lock:
            self._copies.check_consistent()
            check_pages_conserved(
                self.arena,
                self._streams,
                self.prefix,
                self.host,
                moving=list(self._copies.moving_streams()),
                orphaned=list(self._copies.orphaned_streams()),
            )

    def _check(self) -> None:
        if self._debug:
            self.assert_pages_conserved()

    def _drop_stream_storage(self, stream: Stream) -> None:
        if stream.pages:
            self.arena.release(stream.pages)
            stream.pages = []
        if stream.host_pages and self.host is not None:
            self.host.free(stream.host_pages)
            stream.host_pages = []
