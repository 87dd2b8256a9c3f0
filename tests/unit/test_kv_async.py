"""Asynchronous offload/reload: claim -> copy on the worker -> land, observed with the worker held.

The copy worker is paused wherever a test needs a copy to stay in flight, and released with
`copier.step()` (one copy) or `resume()` + `wait_copies()`, so nothing here sleeps or races.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import (
    ADMIT_OK,
    AllocationFailed,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
)

CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)
PS = 4


def make(
    num_pages: int = 9, host: int = 8, prefix: bool = False, async_copy: bool = True
) -> KVCacheResource:
    kv = KVCacheResource(
        KVConfig(
            num_layers=2,
            num_kv_heads=1,
            head_dim=2,
            num_pages=num_pages,
            page_size=PS,
            host_offload_pages=host,
            enable_prefix_cache=prefix,
            async_copy=async_copy,
        )
    )
    kv.copier.pause()
    return kv


def step(rid: str, span: int) -> ResourceStep:
    return ResourceStep(segments=(Segment(rid, "main", span),))


def run(kv: KVCacheResource, rid: str, span: int) -> None:
    st = step(rid, span)
    assert kv.admit(st, CTX) is ADMIT_OK
    plan = kv.plan(st, CTX)
    for layer in range(2):
        k = torch.randn(plan.num_tokens, 1, 2)
        kv.cache.write_tokens(layer, k, -k, plan.write_slots)
    kv.commit(st, CTX)


def stream_bytes(kv: KVCacheResource, rid: str) -> torch.Tensor:
    plan = kv.plan(step(rid, 0), CTX)
    pages = plan.kv_indices.tolist()
    slots = torch.tensor([pages[t // PS] * PS + t % PS for t in range(int(plan.seq_lens[0]))])
    return torch.stack([torch.stack(kv.cache.read_tokens(i, slots)) for i in range(2)])


def dma_error(*args: object) -> None:
    raise RuntimeError("DMA error")


def offloading(kv: KVCacheResource, rid: str) -> bool:
    out = kv.admit(step(rid, 1), CTX)
    return isinstance(out.reason, RequestOffloading) and out.reason.request_id == rid


def test_request_offloading_while_either_copy_is_in_flight_then_ok() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 7)
    before = stream_bytes(kv, "a").clone()
    free = kv.num_free_pages

    assert kv.offload("a") == 2  # claimed: the copy is queued, nothing freed yet
    assert kv.is_offloaded("a") and kv.copy_in_flight("a") and kv.reclaimable("a") == 0
    assert kv.pages_held_by("a") == 2 and kv.num_free_pages == free
    assert kv.num_pages_in_transit == 2 and kv.num_host_pages_used == 2
    assert offloading(kv, "a")
    assert kv.offload("a") == 0  # already moving
    assert not kv.reload("a")  # its offload has not landed: nothing to bring back yet

    assert kv.copier.step() == 1  # the offload lands
    assert kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.pages_held_by("a") == 0 and kv.num_free_pages == free + 2
    assert kv.num_pages_in_transit == 0
    assert offloading(kv, "a")

    kv.ingest_request("b")  # someone else writes over the freed pages
    run(kv, "b", 8)
    kv.remove_request("b")

    assert kv.reload("a")  # claimed: device pages taken, copy queued
    assert kv.is_offloaded("a") and kv.copy_in_flight("a")
    assert kv.pages_held_by("a") == 2 and kv.num_host_pages_used == 2
    assert offloading(kv, "a")
    assert kv.reload("a")  # already on its way
    assert kv.copier.step() == 1  # the reload lands
    assert not kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.num_host_pages_used == 0
    assert torch.equal(stream_bytes(kv, "a"), before)
    run(kv, "a", 1)
    assert kv.stored_len("a") == 8


def test_offload_declines_while_a_step_is_in_flight() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 5)
    st = step("a", 1)
    assert kv.admit(st, CTX) is ADMIT_OK
    assert kv.offload("a") == 0 and not kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.copier.num_pending == 0 and kv.num_host_pages_used == 0
    kv.commit(st, CTX)
    assert kv.offload("a") == 2


def test_offload_declines_when_the_host_pool_is_short() -> None:
    kv = make(host=1)
    kv.ingest_request("a")
    run(kv, "a", 5)
    assert kv.offload("a") == 0 and not kv.copy_in_flight("a")
    assert kv.num_host_pages_used == 0 and kv.copier.num_pending == 0


def test_abort_mid_offload_frees_every_page_once_the_copy_lets_go() -> None:
    kv = make(num_pages=5)  # 4 usable
    kv.ingest_request("a")
    run(kv, "a", 8)
    assert kv.offload("a") == 2
    kv.remove_request("a")
    assert not kv.has_request("a") and not kv.copy_in_flight("a")
    # The copy still reads a's two pages: nobody else may have them yet.
    assert kv.num_free_pages == 2 and kv.num_pages_in_transit == 2
    kv.ingest_request("b")
    out = kv.admit(step("b", 12), CTX)
    assert isinstance(out.reason, AllocationFailed) and out.reason.pages_short == 1
    kv.copier.resume()
    kv.wait_copies()
    assert kv.num_free_pages == 4 and kv.num_host_pages_used == 0
    assert kv.num_pages_in_transit == 0
    run(kv, "b", 12)
    kv.remove_request("b")
    assert kv.num_free_pages == kv.num_pages


def test_abort_mid_reload_frees_every_page_once_the_copy_lets_go() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 8)
    kv.offload("a")
    kv.copier.step()
    assert kv.reload("a") and kv.copy_in_flight("a")
    kv.remove_request("a")
    # The reload still writes two device pages and reads two host pages.
    assert kv.num_free_pages == kv.num_pages - 2 and kv.num_host_pages_used == 2
    assert kv.num_pages_in_transit == 2
    assert kv.copier.step() == 1
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0
    assert kv.num_pages_in_transit == 0


def test_removed_before_the_copy_starts_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 8)
    kv.offload("a")
    kv.remove_request("a")
    assert kv.host is not None
    monkeypatch.setattr(kv.host, "copy_out", lambda *a: pytest.fail("copied for nobody"))
    kv.copier.step()
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0


def test_failed_offload_copy_is_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 7)
    before = stream_bytes(kv, "a").clone()
    assert kv.host is not None

    monkeypatch.setattr(kv.host, "copy_out", dma_error)
    assert kv.offload("a") == 2
    kv.copier.step()
    assert kv.copy_failures == 1
    assert not kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.pages_held_by("a") == 2 and kv.num_host_pages_used == 0
    assert kv.num_pages_in_transit == 0
    assert torch.equal(stream_bytes(kv, "a"), before)
    run(kv, "a", 1)  # back on the device as if never claimed


def test_failed_reload_copy_leaves_the_request_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 7)
    before = stream_bytes(kv, "a").clone()
    kv.offload("a")
    kv.copier.step()
    assert kv.host is not None
    copy_in = kv.host.copy_in

    monkeypatch.setattr(kv.host, "copy_in", dma_error)
    assert kv.reload("a")
    kv.copier.step()
    assert kv.copy_failures == 1
    assert kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.pages_held_by("a") == 0 and kv.num_free_pages == kv.num_pages
    assert kv.num_host_pages_used == 2
    monkeypatch.setattr(kv.host, "copy_in", copy_in)
    assert kv.reload("a")
    kv.copier.step()
    assert torch.equal(stream_bytes(kv, "a"), before)


def test_inline_copy_failure_raises_after_undoing(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = make(async_copy=False)
    kv.ingest_request("a")
    run(kv, "a", 7)
    assert kv.host is not None

    monkeypatch.setattr(kv.host, "copy_out", dma_error)
    with pytest.raises(RuntimeError, match="DMA error"):
        kv.offload("a")
    assert not kv.is_offloaded("a") and kv.pages_held_by("a") == 2
    assert kv.num_host_pages_used == 0 and kv.copy_failures == 1


def test_synchronous_mode_completes_inside_the_call() -> None:
    kv = make(async_copy=False)
    kv.ingest_request("a")
    run(kv, "a", 7)
    before = stream_bytes(kv, "a").clone()
    assert kv.offload("a") == 2
    assert not kv.copy_in_flight("a") and kv.pages_held_by("a") == 0
    assert kv.num_free_pages == kv.num_pages and kv.num_pages_in_transit == 0
    assert kv.reload("a") and not kv.is_offloaded("a")
    assert torch.equal(stream_bytes(kv, "a"), before)
    assert kv.copier.num_pending == 0


def test_shared_prefix_pages_stay_indexed_across_an_async_offload() -> None:
    kv = make(prefix=True)
    prompt = list(range(9))
    kv.ingest_request("a", KVRequestConfig(prompt))
    run(kv, "a", 9)  # 2 indexed pages + 1 private
    assert kv.num_cached_pages == 0
    assert kv.offload("a") == 3  # index-shared pages count: they become idle cache
    assert kv.num_cached_pages == 0 and kv.num_pages_in_transit == 3
    kv.copier.step()
    assert kv.num_cached_pages == 2 and kv.num_free_pages == kv.num_pages - 2
    kv.ingest_request("b")
    assert kv.match_prefix("b", [*prompt, 5]) == 8  # the prefix is still served
    assert kv.reload("a")
    kv.copier.step()
    assert kv.stored_len("a") == 9 and kv.pages_held_by("a") == 3


def test_reset_mid_copy_is_remove_plus_reingest() -> None:
    kv = make(prefix=True)
    tokens = list(range(9))
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", 9)
    assert kv.offload("a") == 3
    kv.reset_request("a", free=True)
    assert kv.has_request("a") and not kv.is_offloaded("a") and not kv.copy_in_flight("a")
    assert kv.stored_len("a") == 0 and kv.pages_held_by("a") == 0
    assert kv.num_pages_in_transit == 3  # the orphaned copy still holds a's old pages
    assert kv.match_prefix("a", tokens) == 8  # ingested, token list kept: matched again
    run(kv, "a", 1)
    kv.copier.step()
    assert kv.num_pages_in_transit == 0 and kv.num_host_pages_used == 0
    kv.remove_request("a")
    assert kv.num_free_pages == kv.num_pages - kv.num_cached_pages


def test_reset_request_recomputes_from_the_kept_token_list() -> None:
    kv = make(prefix=True)
    tokens = list(range(6))
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", 6)
    kv.offload("a")
    kv.copier.step()
    kv.reset_request("a", free=True)
    assert not kv.is_offloaded("a") and kv.num_host_pages_used == 0
    run(kv, "a", 6)  # prefilled again; whole pages are keyed from the kept token list
    assert kv.stored_len("a") == 6 and kv.num_prefix_pages == 1


def test_reset_without_free_keeps_private_pages_as_a_high_water_mark() -> None:
    kv = make()
    kv.ingest_request("pad")
    run(kv, "pad", 6)
    kv.reset_request("pad")
    assert kv.stored_len("pad") == 0 and kv.pages_held_by("pad") == 2
    free = kv.num_free_pages
    run(kv, "pad", 6)  # reuses its own pages
    assert kv.num_free_pages == free
    kv.reset_request("pad", free=True)
    assert kv.pages_held_by("pad") == 0


def test_a_step_in_flight_over_a_reset_stream_drops_its_span() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 4)
    st = step("a", 2)
    assert kv.admit(st, CTX) is ADMIT_OK
    kv.reset_request("a", free=True)
    kv.commit(st, CTX)
    assert kv.stored_len("a") == 0 and kv.pages_held_by("a") == 0


def test_copies_land_while_steps_run_on_other_requests() -> None:
    kv = make(num_pages=49, host=16)  # room for everyone: only the copies vary
    kv.copier.resume()  # the worker runs freely, concurrently with this thread's steps
    for rid in ("a", "b", "c", "d"):
        kv.ingest_request(rid)
        run(kv, rid, 13)
    kept = {rid: stream_bytes(kv, rid).clone() for rid in ("a", "b")}
    kv.ingest_request("x")
    for i in range(40):
        victim = ("a", "b")[i % 2]
        if not kv.copy_in_flight(victim):
            if kv.is_offloaded(victim):
                kv.reload(victim)
            else:
                kv.offload(victim)
        run(kv, "x", 1)
        run(kv, ("c", "d")[i % 2], 1)
    kv.wait_copies()
    for rid, data in kept.items():
        if kv.is_offloaded(rid):
            assert kv.reload(rid)
            kv.wait_copies()
        assert torch.equal(stream_bytes(kv, rid), data)
    assert kv.num_pages_in_transit == 0
    for rid in ("a", "b", "c", "d", "x"):
        kv.remove_request(rid)
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0


def test_wait_copies_refuses_to_hang_on_a_paused_worker() -> None:
    kv = make()
    kv.ingest_request("a")
    run(kv, "a", 4)
    kv.offload("a")
    with pytest.raises(RuntimeError, match="paused"):
        kv.wait_copies()
    kv.cleanup()  # resumes, drains, frees everything
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0
    assert kv.copier.num_pending == 0


def test_wait_copy_progress_returns_when_a_copy_lands_or_the_timeout_passes() -> None:
    """The scheduler's wait when every row waits on a copy: at once with nothing in flight, the
    whole timeout while the copy is held, and early once it lands."""
    kv = make()
    start = time.monotonic()
    kv.wait_copy_progress(5.0)
    assert time.monotonic() - start < 0.5  # nothing in flight: no wait at all
    kv.ingest_request("a")
    run(kv, "a", 4)
    kv.copier.pause()
    assert kv.offload("a") > 0
    start = time.monotonic()
    kv.wait_copy_progress(0.05)
    assert time.monotonic() - start >= 0.045 and kv.copy_in_flight("a")
    release = threading.Timer(0.05, kv.copier.step)
    release.start()
    start = time.monotonic()
    kv.wait_copy_progress(5.0)
    release.join()
    assert time.monotonic() - start < 2.5 and not kv.copy_in_flight("a")
    kv.cleanup()
    assert kv.num_free_pages == kv.num_pages and kv.num_host_pages_used == 0
