"""The same KV behaviours on a CUDA device: device plans, pinned host tier, exact round trips."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import ADMIT_OK, ResourceStep, Segment, StepContext

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
PS = 16


@pytest.fixture(autouse=True)
def _debug_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "1")


def make(num_pages: int = 33, host: int = 16) -> KVCacheResource:
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
