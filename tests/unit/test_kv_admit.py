"""admit / commit / remove: reservations, refusals and the lengths they advance."""

from __future__ import annotations

import pytest

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig, KVStep
from mstar.engine.resources.step import (
    ADMIT_OK,
    AdmitRuntimeError,
    AllocationFailed,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
)

CTX = StepContext(request_ids=[], graph_walk="prefill", slot=0, capture=False)


def make(
    num_pages: int = 9, page_size: int = 4, max_seq_len: int = 4096, host_offload_pages: int = 0
) -> KVCacheResource:
    cfg = KVConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=2,
        num_pages=num_pages,
        page_size=page_size,
        max_seq_len=max_seq_len,
        host_offload_pages=host_offload_pages,
        async_copy=False,
    )
    return KVCacheResource(cfg)


def step(*segs: tuple[str, int]) -> ResourceStep:
    return ResourceStep(segments=tuple(Segment(r, "main", s) for r, s in segs))


def run(kv: KVCacheResource, *segs: tuple[str, int]) -> None:
    st = step(*segs)
    assert kv.admit(st, CTX) is ADMIT_OK
    kv.plan(st, CTX)
    kv.commit(st, CTX)


def test_admit_reserves_whole_pages_and_commit_advances() -> None:
    kv = make()
    kv.ingest_request("a")
    st = step(("a", 5))
    assert kv.admit(st, CTX) is ADMIT_OK
    assert kv.pages_held_by("a") == 2
    assert kv.stored_len("a") == 0  # admit never advances lengths
    kv.plan(st, CTX)
    assert kv.stored_len("a") == 0
    kv.commit(st, CTX)
    assert kv.stored_len("a") == 5
    assert kv.num_free_pages == kv.num_pages - 2


def test_growth_within_the_last_page_and_zero_span_reserve_nothing() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, ("a", 5))
    free = kv.num_free_pages
    run(kv, ("a", 3))  # 8 tokens: fills page 2 exactly
    run(kv, ("a", 0))
    assert kv.num_free_pages == free
    assert kv.stored_len("a") == 8
    run(kv, ("a", 1))  # 9th token needs page 3
    assert kv.num_free_pages == free - 1


def test_zero_span_segment_of_unknown_label_creates_no_stream() -> None:
    kv = make()
    kv.ingest_request("a")
    st = ResourceStep(segments=(Segment("a", "ctx", 0),))
    assert kv.admit(st, CTX) is ADMIT_OK
    assert kv.pages_held_by("a") == 0
    plan = kv.plan(st, CTX)
    assert plan.num_tokens == 0 and plan.kv_indices.numel() == 0


def test_allocation_failed_carries_fields_and_reserves_nothing() -> None:
    kv = make(num_pages=5)  # 4 usable pages
    for rid in ("a", "b"):
        kv.ingest_request(rid)
    run(kv, ("a", 4))  # 1 page
    # a grows to 2 pages (+1), b needs 3: 4 new pages with 3 free.
    out = kv.admit(step(("a", 1), ("b", 9)), CTX)
    assert not out.ok and out.ready
    reason = out.reason
    assert isinstance(reason, AllocationFailed)
    assert reason.pages_short == 1
    assert reason.request_id == "b" and reason.label == "main"
    assert "short" in reason.message
    assert kv.pages_held_by("a") == 1 and kv.pages_held_by("b") == 0
    assert kv.num_free_pages == 3
    # Nothing is in flight after a refusal: a can be offloaded-checked / re-admitted.
    assert kv.admit(step(("a", 1)), CTX) is ADMIT_OK


def test_high_water_pages_are_reused_on_retry() -> None:
    kv = make(num_pages=4)  # 3 usable
    kv.ingest_request("a")
    kv.ingest_request("b")
    st = step(("a", 8))
    assert kv.admit(st, CTX) is ADMIT_OK  # a holds 2 pages, never committed
    kv.abort_step(st, CTX)
    free = kv.num_free_pages
    assert kv.admit(step(("a", 8)), CTX) is ADMIT_OK  # same span: no new pages
    assert kv.num_free_pages == free == 1
    plan = kv.plan(step(("a", 3)), CTX)  # the view slices the mark to the length
    assert plan.kv_indices.tolist() == [1]


def test_offloaded_stream_answers_request_offloading() -> None:
    kv = make(host_offload_pages=4)
    kv.ingest_request("a")
    run(kv, ("a", 5))
    assert kv.offload("a") == 2
    out = kv.admit(step(("a", 1)), CTX)
    assert not out.ok
    assert isinstance(out.reason, RequestOffloading)
    assert out.reason.request_id == "a" and out.reason.label == "main"


def test_request_longer_than_the_pool_is_a_runtime_error() -> None:
    kv = make(num_pages=9, page_size=4)  # 8 usable pages = 32 tokens
    kv.ingest_request("a")
    out = kv.admit(step(("a", 33)), CTX)
    assert not out.ok
    assert isinstance(out.reason, AdmitRuntimeError)
    assert "needs 9 KV pages but the cache has only 8" in out.reason.message
    assert "shorten the prompt or max_tokens" in out.reason.message
    assert kv.num_free_pages == 8


def test_request_longer_than_max_seq_len_is_a_runtime_error() -> None:
    kv = make(max_seq_len=10)
    kv.ingest_request("a")
    run(kv, ("a", 8))
    out = kv.admit(step(("a", 3)), CTX)
    assert isinstance(out.reason, AdmitRuntimeError)
    assert "11 tokens" in out.reason.message and "max_seq_len is 10" in out.reason.message
    assert kv.admit(step(("a", 2)), CTX) is ADMIT_OK


def test_unknown_request_is_refused_not_raised() -> None:
    kv = make()
    out = kv.admit(step(("ghost", 1)), CTX)
    assert isinstance(out.reason, AdmitRuntimeError) and "never ingested" in out.reason.message


def test_step_in_flight_only_after_every_reservation_succeeds() -> None:
    kv = make(num_pages=4, host_offload_pages=8)  # 3 usable
    kv.ingest_request("a")
    kv.ingest_request("b")
    run(kv, ("a", 4))
    out = kv.admit(step(("a", 1), ("b", 12)), CTX)  # fails on b
    assert not out.ok
    assert kv.offload("a") == 1  # a was not marked in flight by the refused admit
    kv.reload("a")
    assert kv.admit(step(("a", 1)), CTX) is ADMIT_OK
    assert kv.offload("a") == 0  # now it is: offload declines
    assert kv.reclaimable("a") == 0


def test_commit_false_reads_without_advancing() -> None:
    kv = make()
    kv.ingest_request("a")
    st = KVStep(segments=(Segment("a", "main", 3),), commit=False)
    assert kv.admit(st, CTX) is ADMIT_OK
    kv.commit(st, CTX)
    assert kv.stored_len("a") == 0
    assert kv.reclaimable("a") == 1  # in-flight mark cleared anyway


def test_ingest_is_idempotent_and_remove_frees_everything() -> None:
    kv = make(host_offload_pages=4)
    tokens = [1, 2, 3]
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, ("a", 6))
    kv.ingest_request("a", KVRequestConfig(tokens))
    assert kv.pages_held_by("a") == 2 and kv.stored_len("a") == 6
    kv.ingest_request("b")
    run(kv, ("b", 4))
    assert kv.offload("b") == 1
    assert kv.num_host_pages_used == 1
    kv.remove_request("a")
    kv.remove_request("b")
    kv.remove_request("never-seen")
    assert kv.num_free_pages == kv.num_pages
    assert kv.num_host_pages_used == 0
    assert not kv.has_request("a")


def test_ingest_rejects_foreign_overrides() -> None:
    kv = make()
    with pytest.raises(TypeError, match="KVRequestConfig"):
        kv.ingest_request("a", {"token_ids": [1]})


def test_usage_stats() -> None:
    kv = make(num_pages=9, host_offload_pages=4)
    assert kv.num_pages == 8 and kv.usage == 0.0 and kv.host_usage == 0.0
    kv.ingest_request("a")
    run(kv, ("a", 8))
    assert kv.usage == pytest.approx(2 / 8)
    kv.offload("a")
    assert kv.usage == 0.0 and kv.host_usage == pytest.approx(2 / 4)


def test_streams_are_keyed_by_label() -> None:
    kv = make()
    kv.ingest_request("a")
    st = ResourceStep(segments=(Segment("a", "main", 4), Segment("a", "draft", 2)))
    assert kv.admit(st, CTX) is ADMIT_OK
    kv.commit(st, CTX)
    assert kv.stored_len("a", "main") == 4 and kv.stored_len("a", "draft") == 2
    assert kv.pages_held_by("a") == 2


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_pages"):
        KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, num_pages=1, page_size=4)
    with pytest.raises(ValueError, match="page_size"):
        KVConfig(num_layers=1, num_kv_heads=1, head_dim=1, num_pages=4, page_size=0)
    cfg = KVConfig(
        num_layers=1, num_kv_heads=1, head_dim=1, num_pages=1, page_size=4, reserve_sink_page=False
    )
    assert cfg.num_usable_pages == 1
