"""`assert_pages_conserved` catches each kind of accounting corruption, and runs under the env."""

from __future__ import annotations

import pytest

from mstar.engine.resources.kv import KVCacheResource, KVConfig
from mstar.engine.resources.step import ResourceStep, Segment, StepContext

CTX = StepContext(request_ids=[], graph_walk="prefill", slot=0, capture=False)


def make() -> KVCacheResource:
    kv = KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            num_pages=6,
            page_size=2,
            host_offload_pages=2,
        )
    )
    kv.ingest_request("a")
    st = ResourceStep(segments=(Segment("a", "main", 3),))
    assert kv.admit(st, CTX).ok
    kv.commit(st, CTX)
    kv.assert_pages_conserved()
    return kv


def test_owner_count_mismatch_is_caught() -> None:
    kv = make()
    kv.arena.owners[kv._streams["a"]["main"].pages[0]] += 1
    with pytest.raises(AssertionError, match="owner count"):
        kv.assert_pages_conserved()


def test_page_both_free_and_owned_is_caught() -> None:
    kv = make()
    kv.arena.allocator.free([kv._streams["a"]["main"].pages[0]])
    with pytest.raises(AssertionError, match="both free and owned"):
        kv.assert_pages_conserved()


def test_leaked_page_is_caught() -> None:
    kv = make()
    kv.arena.allocator.try_allocate(1)  # taken from the free list, owned by nobody
    with pytest.raises(AssertionError, match="leak"):
        kv.assert_pages_conserved()


def test_host_page_leak_is_caught() -> None:
    kv = make()
    assert kv.host is not None
    kv.host.allocator.try_allocate(1)
    with pytest.raises(AssertionError, match="host"):
        kv.assert_pages_conserved()


def test_env_flag_runs_the_check_after_mutations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "1")
    kv = make()
    kv.arena.owners[kv._streams["a"]["main"].pages[0]] += 1
    with pytest.raises(AssertionError):
        kv.remove_request("a")


def test_without_the_flag_mutations_do_not_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MSTAR_KV_DEBUG_ASSERTS", raising=False)
    kv = make()
    kv.arena.allocator.try_allocate(1)
    kv.remove_request("a")  # no check, no raise
    with pytest.raises(AssertionError):
        kv.assert_pages_conserved()
