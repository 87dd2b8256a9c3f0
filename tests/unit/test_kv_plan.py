"""KVPlan addressing for mixed prefill/decode batches, page boundaries included."""

from __future__ import annotations

import pytest
import torch

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVPlan
from mstar.engine.resources.step import ADMIT_OK, ResourceStep, Segment, StepContext

CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
PS = 4


def make(num_pages: int = 32) -> KVCacheResource:
    return KVCacheResource(
        KVConfig(num_layers=2, num_kv_heads=2, head_dim=3, num_pages=num_pages, page_size=PS)
    )


def admit_plan(kv: KVCacheResource, segs: list[tuple[str, int]]) -> tuple[ResourceStep, KVPlan]:
    st = ResourceStep(segments=tuple(Segment(r, "main", s) for r, s in segs))
    assert kv.admit(st, CTX) is ADMIT_OK
    return st, kv.plan(st, CTX)


def expected_slots(pages: list[int], start: int, end: int) -> list[int]:
    return [pages[t // PS] * PS + t % PS for t in range(start, end)]


def test_mixed_prefill_and_decode_batch() -> None:
    kv = make()
    for rid in "abc":
        kv.ingest_request(rid)
    # History: a has 4 tokens (exactly one page), b has 6, c is new.
    st, _ = admit_plan(kv, [("a", 4), ("b", 6)])
    kv.commit(st, CTX)
    a_pages = [1]
    b_pages = [2, 3]
    # a decodes onto a new page (boundary), b decodes inside its page, c prefills 9 tokens.
    _, plan = admit_plan(kv, [("a", 1), ("b", 1), ("c", 9)])
    a_pages.append(4)
    c_pages = [5, 6, 7]
    assert plan.request_ids == ("a", "b", "c")
    assert plan.qo_indptr.tolist() == [0, 1, 2, 11]
    assert plan.kv_indptr.tolist() == [0, 2, 4, 7]
    assert plan.kv_indices.tolist() == a_pages + b_pages + c_pages
    assert plan.kv_last_page_len.tolist() == [1, 3, 1]
    assert plan.seq_lens.tolist() == [5, 7, 9]
    assert plan.prefix_lens.tolist() == [4, 6, 0]
    assert plan.num_tokens == 11 and not plan.is_decode and plan.page_size == PS
    assert plan.write_slots.tolist() == (
        expected_slots(a_pages, 4, 5)
        + expected_slots(b_pages, 6, 7)
        + expected_slots(c_pages, 0, 9)
    )
    for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len):
        assert t.dtype == torch.int32 and t.device.type == "cpu"
    assert plan.write_slots.dtype == torch.int64


def test_pure_decode_batch_is_decode_and_fills_last_page() -> None:
    kv = make()
    for rid in "ab":
        kv.ingest_request(rid)
    st, _ = admit_plan(kv, [("a", 3), ("b", 7)])
    kv.commit(st, CTX)
    _, plan = admit_plan(kv, [("a", 1), ("b", 1)])
    assert plan.is_decode and plan.num_tokens == 2
    assert plan.kv_last_page_len.tolist() == [4, 4]  # 4 % 4 == 0 reads as a full page
    assert plan.kv_indptr.tolist() == [0, 1, 3]
    assert plan.write_slots.tolist() == [1 * PS + 3, 3 * PS + 3]


def test_prefill_continuing_mid_page_spans_boundaries() -> None:
    kv = make()
    kv.ingest_request("a")
    st, _ = admit_plan(kv, [("a", 2)])
    kv.commit(st, CTX)
    _, plan = admit_plan(kv, [("a", 7)])  # tokens 2..8 over pages 0,1,2 of the stream
    pages = plan.kv_indices.tolist()
    assert len(pages) == 3
    assert plan.write_slots.tolist() == expected_slots(pages, 2, 9)
    assert plan.kv_last_page_len.tolist() == [1]
    assert plan.prefix_lens.tolist() == [2] and plan.seq_lens.tolist() == [9]


def test_zero_span_rows_read_without_writing() -> None:
    kv = make()
    kv.ingest_request("a")
    kv.ingest_request("b")
    st, _ = admit_plan(kv, [("a", 5)])
    kv.commit(st, CTX)
    _, plan = admit_plan(kv, [("a", 0), ("b", 2)])
    assert plan.qo_indptr.tolist() == [0, 0, 2]
    assert plan.kv_indptr.tolist() == [0, 2, 3]
    assert plan.kv_last_page_len.tolist() == [1, 2]
    assert plan.num_tokens == 2 and len(plan.write_slots) == 2 and not plan.is_decode


def test_high_water_mark_never_reaches_addressing() -> None:
    kv = make()
    kv.ingest_request("a")
    st, _ = admit_plan(kv, [("a", 12)])  # reserves 3 pages
    kv.abort_step(st, CTX)
    _, plan = admit_plan(kv, [("a", 5)])
    assert plan.kv_indptr.tolist() == [0, 2]
    assert len(plan.kv_indices) == 2


def test_plan_without_admit_raises() -> None:
    kv = make()
    kv.ingest_request("a")
    st = ResourceStep(segments=(Segment("a", "main", 3),))
    with pytest.raises(RuntimeError, match="not admitted"):
        kv.plan(st, CTX)


def test_write_slots_address_the_layer_view() -> None:
    kv = make()
    kv.ingest_request("a")
    kv.ingest_request("b")
    _st, plan = admit_plan(kv, [("a", 6), ("b", 3)])
    view = kv.cache.layer_view(1)
    assert view.shape == (32, 2, PS, 2, 3)
    assert kv.cache.tensor.shape == (2, 32, 2, PS, 2, 3)
    k = torch.randn(9, 2, 3)
    v = torch.randn(9, 2, 3)
    kv.cache.write_tokens(1, k, v, plan.write_slots)
    # The plan's pages / last_page_len locate the same values in the kernel's view.
    a_pages = plan.kv_indices[0:2].tolist()
    assert torch.equal(view[a_pages[0], 0], k[0:4])
    assert torch.equal(view[a_pages[1], 1, :2], v[4:6])
    rk, rv = kv.cache.read_tokens(1, plan.write_slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    assert kv.cache.tensor[0].abs().sum() == 0  # other layers untouched


def test_empty_step_plans_empty() -> None:
    kv = make()
    plan = kv.plan(ResourceStep(segments=()), CTX)
    assert plan.request_ids == () and plan.qo_indptr.tolist() == [0]
    assert plan.num_tokens == 0 and not plan.is_decode
