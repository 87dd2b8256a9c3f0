"""Page allocator, arena owner counts, and conservation under two threads."""

from __future__ import annotations

import threading

import pytest

from mstar.engine.resources.kv import (
    SINK_PAGE,
    KVCacheResource,
    KVConfig,
    PageAllocator,
    PageArena,
    PagesExhausted,
)
from mstar.engine.resources.step import ResourceStep, Segment, StepContext


def test_allocator_is_fifo_and_refuses_whole_requests() -> None:
    alloc = PageAllocator(6, reserved=(0,))
    assert alloc.num_free == 5
    assert alloc.try_allocate(2) == [1, 2]
    assert alloc.try_allocate(4) is None  # only 3 free: takes nothing
    assert alloc.num_free == 3
    alloc.free([2])
    assert alloc.try_allocate(4) == [3, 4, 5, 2]
    with pytest.raises(PagesExhausted):
        alloc.allocate(1)
    assert alloc.try_allocate(0) == []


def test_arena_frees_a_page_only_at_zero_owners() -> None:
    arena = PageArena(4, reserve_sink=True)
    assert arena.sink_page == SINK_PAGE and arena.owners[SINK_PAGE] == 1
    assert arena.num_usable == 3
    pages = arena.acquire(2)
    assert pages == [1, 2]
    arena.retain([1])
    assert arena.release([1, 2]) == 1  # page 2 freed, page 1 still owned once
    assert arena.owners[1] == 1 and arena.num_free == 2
    assert arena.release([1]) == 1
    with pytest.raises(AssertionError, match="released more times"):
        arena.release([1])


def test_two_threads_allocating_and_freeing_conserve_pages() -> None:
    alloc = PageAllocator(64)
    seen: list[list[int]] = [[], []]
    errors: list[str] = []

    def worker(slot: int) -> None:
        for i in range(2000):
            pages = alloc.try_allocate(1 + i % 5)
            if pages is None:
                continue
            seen[slot].extend(pages)
            held = set(pages)
            if len(held) != len(pages):
                errors.append("duplicate page within one allocation")
            alloc.free(pages)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    free = alloc.free_pages()
    assert sorted(free) == list(range(64))  # nothing lost, nothing doubled
    assert seen[0] and seen[1]


def test_two_threads_driving_requests_conserve_pages() -> None:
    kv = KVCacheResource(
        KVConfig(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=33, page_size=4)
    )
    ctx = StepContext(request_ids=[], graph_walk="decode", slot=0, capture=False)
    failures: list[str] = []

    def worker(tag: str) -> None:
        for i in range(150):
            rid = f"{tag}-{i}"
            kv.ingest_request(rid)
            step = ResourceStep(segments=(Segment(rid, "main", 1 + i % 9),))
            out = kv.admit(step, ctx)
            if out.ok:
                plan = kv.plan(step, ctx)
                if plan.num_tokens != 1 + i % 9:
                    failures.append(f"{rid}: planned {plan.num_tokens} tokens")
                kv.commit(step, ctx)
                for _ in range(3):
                    decode = ResourceStep(segments=(Segment(rid, "main", 1),))
                    if kv.admit(decode, ctx).ok:
                        kv.plan(decode, ctx)
                        kv.commit(decode, ctx)
            kv.remove_request(rid)

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    kv.assert_pages_conserved()
    assert kv.num_free_pages == kv.num_pages == 32
