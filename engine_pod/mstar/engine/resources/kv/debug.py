"""Page-conservation checks, run after every mutation when ``MSTAR_KV_DEBUG_ASSERTS=1``."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping

from mstar.engine.resources.kv.allocator import PageArena
from mstar.engine.resources.kv.host import HostPagePool
from mstar.engine.resources.kv.prefix import PrefixIndex
from mstar.engine.resources.kv.stream import Stream

__all__ = ["check_pages_conserved", "debug_asserts_enabled"]

DEBUG_ENV = "MSTAR_KV_DEBUG_ASSERTS"


def debug_asserts_enabled() -> bool:
    """Read once per manager: the check walks every page, far too slow for production."""
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def check_pages_conserved(
    arena: PageArena,
    streams: Mapping[str, Mapping[str, Stream]],
    index: PrefixIndex | None,
    host: HostPagePool | None,
    moving: Collection[Stream] = (),
    orphaned: Iterable[Stream] = (),
) -> None:
    """Raise AssertionError unless every device and host page is accounted for exactly.

    Device: each page's owner count equals its references (streams + streams of copies whose
    request is gone + index + sink); no page is both free and owned; free + owned == total; the
    prefix index's incremental idle count and leaf heap agree with a recount. Host: every host
    page is either free or held by exactly one stream. Tiers: a stream holds host pages only
    while offloaded, and device pages while offloaded only while a copy (``moving``) moves it.
    """
    refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    moving_ids = {id(s) for s in moving}
    sink = arena.sink_page
    for rid, per in streams.items():
        for label, stream in per.items():
            refs.update(p for p in stream.pages if p != sink)  # a sliding group's holes
            host_refs.update(stream.host_pages)
            in_copy = id(stream) in moving_ids
            if stream.offloaded and stream.pages and not in_copy:
                raise AssertionError(
                    f"offloaded stream {rid}/{label} holds device pages with no copy in flight"
                )
            if not stream.offloaded and (stream.host_pages or in_copy):
                raise AssertionError(f"resident stream {rid}/{label} holds host pages or moves")
    for stream in orphaned:
        refs.update(p for p in stream.pages if p != sink)
        host_refs.update(stream.host_pages)
    if index is not None:
        refs.update(index.pages())
        index.check_consistent()
    if arena.sink_page is not None:
        refs[arena.sink_page] += 1
    owners = arena.owners
    for page in range(arena.num_pages):
        if owners[page] != refs.get(page, 0):
            raise AssertionError(
                f"page {page}: owner count {owners[page]} but {refs.get(page, 0)} references"
            )
    _check_free_list(arena.allocator.free_pages(), arena.num_pages, owners.__getitem__, "device")
    if host is not None:
        dup = [p for p, n in host_refs.items() if n > 1]
        if dup:
            raise AssertionError(f"host pages held twice: {dup}")
        _check_free_list(
            host.allocator.free_pages(), host.num_pages, lambda p: host_refs.get(p, 0), "host"
        )
    elif host_refs:
        raise AssertionError("streams hold host pages but there is no host tier")


def _check_free_list(
    free: Iterable[int], total: int, count: Callable[[int], int], tier: str
) -> None:
    free_list = list(free)
    free_set = set(free_list)
    if len(free_set) != len(free_list):
        raise AssertionError(f"{tier} free list holds a page twice")
    both = [p for p in free_set if count(p)]
    if both:
        raise AssertionError(f"{tier} pages both free and owned: {sorted(both)}")
    owned_pages = sum(1 for p in range(total) if count(p))
    if owned_pages + len(free_set) != total:
        raise AssertionError(
            f"{tier}: {len(free_set)} free + {owned_pages} owned != {total} pages (leak)"
        )
