"""The same KV behaviours on a CUDA device: device plans, pinned host tier, exact round trips,
and the asynchronous copy stream ordered after the compute stream's queued work."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import (
    ADMIT_OK,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
PS = 16


def make(num_pages: int = 33, host: int = 16, async_copy: bool = False) -> KVCacheResource:
    return KVCacheResource(
        KVConfig(
            num_layers=2,
            num_kv_heads=2,
            head_dim=64,
            num_pages=num_pages,
            page_size=PS,
            dtype=torch.bfloat16,
            device="cuda",
            host_offload_pages=host,
            enable_prefix_cache=True,
            async_copy=async_copy,
        )
    )


def run(kv: KVCacheResource, segs: list[tuple[str, int]]) -> None:
    st = ResourceStep(segments=tuple(Segment(r, "main", s) for r, s in segs))
    assert kv.admit(st, CTX) is ADMIT_OK
    plan = kv.plan(st, CTX)
    assert plan.write_slots.device.type == "cuda"
    assert plan.kv_indptr.device.type == "cpu" and plan.kv_indptr.dtype == torch.int32
    for layer in range(2):
        k = torch.randn(plan.num_tokens, 2, 64, device="cuda")
        v = torch.randn(plan.num_tokens, 2, 64, device="cuda")
        kv.cache.write_tokens(layer, k, v, plan.write_slots)
        rk, rv = kv.cache.read_tokens(layer, plan.write_slots)
        assert torch.equal(rk, k.to(torch.bfloat16)) and torch.equal(rv, v.to(torch.bfloat16))
    kv.commit(st, CTX)


def test_cuda_plan_offload_reload_round_trip() -> None:
    kv = make()
    assert kv.host is not None and kv.host.tensor.is_pinned()
    for rid in ("a", "b"):
        kv.ingest_request(rid)
    run(kv, [("a", 40), ("b", 17)])
    run(kv, [("a", 1), ("b", 1)])
    pages = kv._streams["a"]["main"].pages[:3]
    before = kv.cache.gather_pages(pages).clone()
    assert kv.offload("a") == 3
    run(kv, [("b", 40)])  # reuses a's freed pages
    assert kv.reload("a")
    after = kv.cache.gather_pages(kv._streams["a"]["main"].pages[:3])
    assert torch.equal(after, before)
    kv.remove_request("a")
    kv.remove_request("b")
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0


def test_cuda_prefix_sharing() -> None:
    kv = make()
    prompt = list(range(40))
    kv.ingest_request("a", KVRequestConfig(prompt))
    run(kv, [("a", 40)])
    kv.ingest_request("b", KVRequestConfig([*prompt, 1]))
    assert kv.match_prefix("b", [*prompt, 1]) == 32
    run(kv, [("b", 9)])
    assert kv._streams["b"]["main"].pages[:2] == kv._streams["a"]["main"].pages[:2]


def pages_of(kv: KVCacheResource, rid: str) -> list[int]:
    return list(kv._streams[rid]["main"].pages)


def test_cuda_async_round_trip_through_pinned_page_major_host_pages() -> None:
    kv = make(async_copy=True)
    host = kv.host
    assert host is not None and host.tensor.is_pinned()
    assert host.tensor.shape[0] == 16  # page-major: one host page is one contiguous block
    kv.copier.pause()
    for rid in ("a", "b"):
        kv.ingest_request(rid)
    run(kv, [("a", 40), ("b", 17)])
    before = kv.cache.gather_pages(pages_of(kv, "a")).clone()
    assert kv.offload("a") == 3
    out = kv.admit(ResourceStep(segments=(Segment("a", "main", 1),)), CTX)
    assert isinstance(out.reason, RequestOffloading)
    assert kv.copier.step() == 1
    run(kv, [("b", 40)])  # reuses a's freed pages
    assert kv.reload("a") and kv.copy_in_flight("a")
    assert kv.copier.step() == 1
    assert torch.equal(kv.cache.gather_pages(pages_of(kv, "a")), before)
    kv.copier.resume()
    kv.remove_request("a")
    kv.remove_request("b")
    kv.evict_prefix_cache()
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0


def test_cuda_offload_copy_waits_for_writes_queued_on_the_compute_stream() -> None:
    kv = make(async_copy=True)
    kv.ingest_request("a")
    run(kv, [("a", 32)])
    pages = pages_of(kv, "a")
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy...
    kv.cache.tensor[:, pages] = 3.0  # ...so this write is still queued when the copy starts
    assert kv.offload("a") == 2
    kv.wait_copies()
    assert kv.host is not None
    host_pages = kv._streams["a"]["main"].host_pages
    assert torch.all(kv.host.tensor[host_pages] == 3.0)


def test_cuda_reload_waits_for_the_previous_owners_queued_work() -> None:
    kv = make(num_pages=5, async_copy=True)  # 4 usable pages
    kv.ingest_request("a")
    run(kv, [("a", 32)])
    before = kv.cache.gather_pages(pages_of(kv, "a")).clone()
    assert kv.offload("a") == 2
    kv.wait_copies()
    kv.ingest_request("b")
    run(kv, [("b", 64)])  # b now owns every page
    b_pages = pages_of(kv, "b")
    torch.cuda._sleep(200_000_000)
    kv.cache.tensor[:, b_pages] = 9.0  # b's last queued write, still pending...
    kv.remove_request("b")  # ...when its pages are freed and handed to a's reload
    assert kv.reload("a")
    kv.wait_copies()
    assert set(pages_of(kv, "a")) <= set(b_pages)
    assert torch.equal(kv.cache.gather_pages(pages_of(kv, "a")), before)
