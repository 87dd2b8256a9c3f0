"""Host offload / reload: exact bytes, all-or-nothing, declines, and prefix interplay."""

from __future__ import annotations

import torch

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import ADMIT_OK, ResourceStep, Segment, StepContext

CTX = StepContext(request_ids=[], graph_walk="prefill", slot=0, capture=False)
PS = 4


def make(num_pages: int = 9, host: int = 8, prefix: bool = False) -> KVCacheResource:
    return KVCacheResource(
        KVConfig(
            num_layers=3,
            num_kv_heads=2,
            head_dim=4,
            num_pages=num_pages,
            page_size=PS,
            host_offload_pages=host,
            enable_prefix_cache=prefix,
            async_copy=False,
        )
    )


def run(kv: KVCacheResource, rid: str, span: int, fill: bool = True) -> None:
    st = ResourceStep(segments=(Segment(rid, "main", span),))
    assert kv.admit(st, CTX) is ADMIT_OK
    plan = kv.plan(st, CTX)
    if fill:
        for layer in range(kv.cache.num_layers):
            k = torch.randn(plan.num_tokens, 2, 4)
            v = torch.randn(plan.num_tokens, 2, 4)
            kv.cache.write_tokens(layer, k, v, plan.write_slots)
    kv.commit(st, CTX)


def stream_bytes(kv: KVCacheResource, rid: str) -> torch.Tensor:
    """Every stored token's K and V, all layers, read through a fresh plan."""
    st = ResourceStep(segments=(Segment(rid, "main", 0),))
    plan = kv.plan(st, CTX)
    pages = plan.kv_indices.tolist()
    slots = torch.tensor(
        [pages[t // PS] * PS + t % PS for t in range(int(plan.seq_lens[0]))], dtype=torch.long
    )
    return torch.stack([torch.stack(kv.cache.read_tokens(i, slots)) for i in range(3)])


def test_offload_then_reload_restores_bytes_exactly() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 7)
    before = stream_bytes(kv, "a").clone()
    assert kv.reclaimable("a") == 2 and kv.get_offload_priority("a") == 2.0
    assert kv.offload("a") == 2
    assert kv.is_offloaded("a")
    assert kv.pages_held_by("a") == 0 and kv.num_free_pages == kv.num_pages
    assert kv.num_host_pages_used == 2 and kv.reclaimable("a") == 0
    # Someone else scribbles over the freed device pages.
    kv.ingest_request("b")
    run(kv, "b", 8)
    assert kv.reload("a")
    assert not kv.is_offloaded("a") and kv.num_host_pages_used == 0
    assert kv.stored_len("a") == 7
    assert torch.equal(stream_bytes(kv, "a"), before)
    run(kv, "a", 1)  # the stream goes on decoding
    assert kv.stored_len("a") == 8


def test_reload_refuses_when_short_and_moves_nothing() -> None:
    kv = make(num_pages=5)  # 4 usable
    kv.ingest_request("a")
    run(kv, "a", 8)
    assert kv.offload("a") == 2
    kv.ingest_request("b")
    run(kv, "b", 12)  # 3 pages: one left
    host_before = kv.host.tensor.clone() if kv.host else None
    assert not kv.reload("a")
    assert kv.is_offloaded("a") and kv.num_free_pages == 1 and kv.num_host_pages_used == 2
    assert kv.host is not None and host_before is not None
    # Bitwise: the pool is allocated uninitialised, so unused pages may hold NaN patterns.
    assert torch.equal(kv.host.tensor.view(torch.int32), host_before.view(torch.int32))
    kv.remove_request("b")
    assert kv.reload("a") and kv.pages_held_by("a") == 2


def test_offload_declines() -> None:
    no_host = make(host=0)
    no_host.ingest_request("a")
    run(no_host, "a", 4)
    assert no_host.offload("a") == 0 and not no_host.is_offloaded("a")

    kv = make(host=1)
    kv.ingest_request("empty")
    assert kv.offload("empty") == 0  # holds nothing
    assert kv.offload("unknown") == 0
    kv.ingest_request("a")
    run(kv, "a", 5)
    assert kv.offload("a") == 0  # host pool short (needs 2)
    assert not kv.is_offloaded("a") and kv.pages_held_by("a") == 2
    kv.ingest_request("b")
    st = ResourceStep(segments=(Segment("b", "main", 2),))
    assert kv.admit(st, CTX) is ADMIT_OK
    assert kv.offload("b") == 0  # step in flight
    kv.commit(st, CTX)
    assert kv.offload("b") == 1
    assert kv.offload("b") == 0  # already offloaded


def test_remove_request_frees_host_pages() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 6)
    kv.offload("a")
    kv.remove_request("a")
    assert kv.num_host_pages_used == 0 and kv.num_free_pages == kv.num_pages


def test_reload_of_resident_request_is_a_no_op() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 3)
    assert kv.reload("a") and kv.reload("unknown")
    assert kv.pages_held_by("a") == 1


def test_high_water_pages_are_released_not_copied() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 3)
    st = ResourceStep(segments=(Segment("a", "main", 9),))
    assert kv.admit(st, CTX) is ADMIT_OK
    kv.abort_step(st, CTX)
    assert kv.pages_held_by("a") == 3
    assert kv.offload("a") == 3
    assert kv.num_host_pages_used == 1
    assert kv.reload("a") and kv.pages_held_by("a") == 1


def test_shared_prefix_pages_and_offload() -> None:
    kv = make(num_pages=9, prefix=True)
    prompt = list(range(9))
    kv.ingest_request("a", KVRequestConfig(prompt))
    run(kv, "a", 9)  # pages: 2 indexed + 1 private
    kv.ingest_request("b", KVRequestConfig([*prompt, 1]))
    assert kv.match_prefix("b", [*prompt, 1]) == 8
    run(kv, "b", 2)
    # a's two indexed pages are shared with b: only a's private page counts.
    assert kv.reclaimable("a") == 1
    assert kv.offload("a") == 1
    assert kv.num_host_pages_used == 3  # the host copy is self-contained
    kv.remove_request("b")
    # Index-only pages left by the offloaded request stay evictable.
    assert kv.evict_prefix_cache() == 2
    assert kv.reload("a") and kv.stored_len("a") == 9
    kv.remove_request("a")
    assert kv.num_free_pages == kv.num_pages


def test_reloaded_request_keeps_chaining_onto_the_index() -> None:
    kv = make(num_pages=9, prefix=True)
    tokens = list(range(6))
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", 6)
    assert kv.num_prefix_pages == 1
    assert kv.offload("a") == 2
    assert kv.reload("a")
    tokens.extend([6, 7])
    run(kv, "a", 2)
    assert kv.num_prefix_pages == 2
    kv.ingest_request("b")
    assert kv.match_prefix("b", [*tokens, 99]) == 8
