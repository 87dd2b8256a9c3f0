"""`HostOffload`: the KV cache's eviction to host memory, offload and reload.

Claim -> copy -> land. The claim (under the lock) marks the streams moving and reserves the
destination pages; the copy runs outside the lock, on the copy worker's thread
(`KVConfig.async_copy`, the default) or inline; the landing (under the lock) releases the
source pages. From claim to landing `admit` answers `RequestOffloading` for the request. A copy
that raises is undone; a request removed mid-copy gets every page back once the copy lets go
of it.

A mixin of `KVCacheResource`: it works on the cache's streams, arena, host pool and lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from mstar.engine.resources.kv.allocator import PageArena
from mstar.engine.resources.kv.config import pages_for
from mstar.engine.resources.kv.copier import CopyWorker
from mstar.engine.resources.kv.groups import HOLE
from mstar.engine.resources.kv.host import HostPagePool
from mstar.engine.resources.kv.prefix import PrefixIndex
from mstar.engine.resources.kv.stream import Stream
from mstar.engine.resources.kv.transfer import Copy, CopyLedger, Move

__all__ = ["HostOffload"]

log = logging.getLogger(__name__)


class HostOffload:
    """`offload` / `reload` / `reclaimable` of the resource protocol, for the paged KV cache."""

    # The cache's state, set by `KVCacheResource.__init__`.
    page_size: int
    arena: PageArena
    prefix: PrefixIndex | None
    host: HostPagePool | None
    copier: CopyWorker
    copy_failures: int
    _streams: dict[str, dict[str, Stream]]
    _lock: threading.RLock
    _copies: CopyLedger
    _async_copy: bool
    _check: Callable[[], None]
    _drop_stream_storage: Callable[[Stream], None]

    def is_offloaded(self, request_id: str) -> bool:
        with self._lock:
            per = self._streams.get(request_id)
            return per is not None and any(s.offloaded for s in per.values())

    def reclaimable(self, request_id: str) -> int:
        """Device pages an offload would give back now.

        Counts held pages that no *other request* holds: a page shared only with the prefix
        index counts (after the offload it is index-only and evictable), a page another live
        stream also holds does not. 0 while offloaded or while a step is in flight (offload
        would decline).
        """
        with self._lock:
            per = self._streams.get(request_id)
            if per is None:
                return 0
            return self._reclaimable_locked(per)

    def _reclaimable_locked(self, per: dict[str, Stream]) -> int:
        if any(s.step_in_flight or s.offloaded for s in per.values()):
            return 0
        owners = self.arena.owners
        prefix = self.prefix
        count = 0
        for stream in per.values():
            for page in stream.pages[stream.dropped :]:
                others = owners[page] - 1 - (1 if prefix is not None and prefix.holds(page) else 0)
                if others == 0:
                    count += 1
        return count

    def get_offload_priority(self, request_id: str) -> float:
        return float(self.reclaimable(request_id))

    def offload(self, request_id: str) -> int:
        """Claim the request's streams for a move to host memory; returns `reclaimable` pages.

        Declines (0) with no host tier, while a step is in flight, when the request holds no
        page it alone keeps, when it is already offloaded or moving, or when the host pool is
        short. Otherwise the host pages are reserved, the streams are marked offloaded (admit
        answers `RequestOffloading` from now on) and the copy is started; the device pages are
        released when it lands (`num_pages_in_transit` until then; inside this call when
        ``async_copy`` is off). Only the pages covering each stream's stored length are copied;
        high-water pages beyond it are simply released.
        """
        host = self.host
        if host is None:
            return 0
        ps = self.page_size
        with self._lock:
            per = self._streams.get(request_id)
            if per is None or request_id in self._copies:
                return 0
            freed = self._reclaimable_locked(per)
            if freed == 0:
                return 0
            live = [s for s in per.values() if s.pages]
            # A sliding group's holes stay holes: only its live pages travel.
            needed = [s.pages[s.dropped : pages_for(s.stored_len, ps)] for s in live]
            host_pages = host.reserve(sum(len(pages) for pages in needed))
            if host_pages is None:
                return 0
            moves = []
            start = 0
            for stream, pages in zip(live, needed, strict=True):
                stream.host_pages = host_pages[start : start + len(pages)]
                start += len(pages)
                stream.offloaded = True
                moves.append(Move(stream, pages, stream.host_pages))
            copy = Copy(request_id, True, moves, freed, host.mark_ready())
            self._copies.add(copy)
            self._check()
        self._launch(copy)
        return freed

    def reload(self, request_id: str) -> bool:
        """Start bringing an offloaded request back, all or nothing.

        False (moving nothing) when the device is short even after evicting idle index
        leaves, or while the request's offload copy has not landed yet. True otherwise: the
        device pages are taken now and the copy started; `is_offloaded` stays True (and admit
        answers `RequestOffloading`) until it lands. True for a resident request or one whose
        reload is already on its way. Restored pages are private copies (no longer shared with
        the index); the stream's prefix keys are kept so its next filled page still chains onto
        the indexed prefix.
        """
        with self._lock:
            per = self._streams.get(request_id)
            if per is None:
                return True
            moving = self._copies.get(request_id)
            if moving is not None:
                return not moving.offload
            back = [s for s in per.values() if s.offloaded]
            if not back:
                return True
            total = sum(len(s.host_pages) for s in back)
            pages = self.arena.acquire(total)
            if pages is None and self.prefix is not None:
                self.prefix.evict(total - self.arena.num_free)
                pages = self.arena.acquire(total)
            if pages is None:
                return False
            assert self.host is not None
            moves = []
            start = 0
            for stream in back:
                n = len(stream.host_pages)
                fresh = pages[start : start + n]
                stream.pages = [HOLE] * stream.dropped + fresh
                start += n
                moves.append(Move(stream, fresh, stream.host_pages))
            copy = Copy(request_id, False, moves, 0, self.host.mark_ready())
            self._copies.add(copy)
            self._check()
        self._launch(copy)
        return True

    def _launch(self, copy: Copy) -> None:
        if self._async_copy:
            self.copier.submit(lambda: self._run_copy(copy))
        else:
            self._run_copy(copy)

    def _run_copy(self, copy: Copy) -> None:
        """Copy outside the lock, then land under it; a copy that raised is undone."""
        ok = False
        try:
            if not copy.detached:  # removed before it started: nothing worth copying
                host = self.host
                assert host is not None
                if copy.offload:
                    host.copy_out(copy.device_pages(), copy.host_pages(), copy.ready)
                else:
                    host.copy_in(copy.host_pages(), copy.device_pages(), copy.ready)
            ok = True
        except Exception:
            if not self._async_copy:
                raise
            log.exception(
                "KV %s of request %r failed; undone",
                "offload" if copy.offload else "reload",
                copy.request_id,
            )
        finally:
            with self._lock:
                if not ok:
                    self.copy_failures += 1
                self._land(copy, ok)

    def _land(self, copy: Copy, ok: bool) -> None:
        """Finish a copy under the lock: commit it when it succeeded and is current, else undo."""
        self._copies.finish(copy)
        arena = self.arena
        host = self.host
        assert host is not None
        if copy.detached:  # removed or reset mid-copy: the removal owes every page
            for move in copy.moves:
                self._drop_stream_storage(move.stream)
        elif copy.offload:
            current = all(m.stream.generation == m.generation for m in copy.moves)
            for move in copy.moves:
                stream = move.stream
                if ok and current:
                    arena.release(stream.pages)
                    stream.pages = []
                else:  # the copy failed or is stale: back on the device, as if never claimed
                    host.free(stream.host_pages)
                    stream.host_pages = []
                    stream.offloaded = False
        else:
            for move in copy.moves:
                stream = move.stream
                if ok:
                    host.free(stream.host_pages)
                    stream.host_pages = []
                    stream.offloaded = False
                    stream.generation += 1
                else:  # still on the host; a later reload may try again
                    arena.release(stream.pages)
                    stream.pages = []
        self._check()
