"""Prefix cache: hash-chain keys, one-short matching, read-only sharing, LRU leaf eviction."""

from __future__ import annotations

import pytest
import torch
from counting import CountingDict

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig, chain_key
from mstar.engine.resources.step import (
    ADMIT_OK,
    AllocationFailed,
    ResourceStep,
    Segment,
    StepContext,
)

CTX = StepContext(request_ids=[], graph_walk="prefill", slot=0, capture=False)
PS = 4


def make(num_pages: int = 17, prefix: bool = True) -> KVCacheResource:
    return KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=2,
            num_pages=num_pages,
            page_size=PS,
            enable_prefix_cache=prefix,
        )
    )


def run(kv: KVCacheResource, rid: str, span: int, ctx: StepContext = CTX) -> None:
    st = ResourceStep(segments=(Segment(rid, "main", span),))
    assert kv.admit(st, ctx) is ADMIT_OK
    kv.plan(st, ctx)
    kv.commit(st, ctx)


def prefill(kv: KVCacheResource, rid: str, tokens: list[int]) -> int:
    kv.ingest_request(rid, KVRequestConfig(tokens))
    matched = kv.match_prefix(rid, tokens)
    run(kv, rid, len(tokens) - matched)
    return matched


def test_chain_key_depends_on_every_earlier_token() -> None:
    a = chain_key(b"", [1, 2, 3, 4])
    assert a == chain_key(b"", [1, 2, 3, 4])
    assert chain_key(a, [5, 6, 7, 8]) != chain_key(chain_key(b"", [1, 2, 3, 9]), [5, 6, 7, 8])


def test_second_request_reuses_whole_pages_and_counts_tokens() -> None:
    kv = make()
    prompt = list(range(100, 110))  # 10 tokens: 2 whole pages + 2
    assert prefill(kv, "a", prompt) == 0
    assert kv.num_prefix_pages == 2
    assert prefill(kv, "b", [*prompt, 7, 7]) == 8
    assert kv.stored_len("b") == 12
    assert kv.prefix_queries == 10 + 12 and kv.prefix_hits == 8
    # A later call changes nothing and answers what the cache holds for the request.
    assert kv.match_prefix("b", prompt) == 12
    assert kv.prefix_queries == 22 and kv.prefix_hits == 8
    kv.ingest_request("c")
    assert kv.match_prefix("c", prompt) == 8
    assert kv.match_prefix("c", prompt) == 8  # repeated before admit: same answer, counted once
    assert kv.prefix_queries == 32 and kv.prefix_hits == 16


def test_match_leaves_at_least_one_token_to_compute() -> None:
    kv = make()
    prompt = list(range(8))  # exactly two pages
    prefill(kv, "a", prompt)
    kv.ingest_request("b", KVRequestConfig(list(prompt)))
    assert kv.match_prefix("b", prompt) == 4  # not 8: the last token must be computed


def test_divergent_prompt_matches_only_the_common_pages() -> None:
    kv = make()
    prefill(kv, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    kv.ingest_request("b")
    assert kv.match_prefix("b", [1, 2, 3, 4, 5, 6, 7, 0, 9]) == 4
    kv.ingest_request("c")
    assert kv.match_prefix("c", [9, 2, 3, 4, 5, 6, 7, 8, 9]) == 0


def test_shared_pages_are_never_written() -> None:
    kv = make()
    prompt = list(range(9))
    prefill(kv, "a", prompt)
    shared = set(kv._streams["a"]["main"].pages[:2])
    kv.ingest_request("b", KVRequestConfig([*prompt, 50, 51]))
    assert kv.match_prefix("b", [*prompt, 50, 51]) == 8
    st = ResourceStep(segments=(Segment("b", "main", 3),))
    assert kv.admit(st, CTX) is ADMIT_OK
    plan = kv.plan(st, CTX)
    written = {s // PS for s in plan.write_slots.tolist()}
    assert not written & shared
    assert set(plan.kv_indices.tolist()[:2]) == shared  # but they are read


def test_decode_tokens_index_as_they_fill_pages() -> None:
    kv = make()
    tokens = [1, 2, 3]
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", 3)
    assert kv.num_prefix_pages == 0
    tokens.append(4)  # the scheduler appends the sampled token, then decodes it
    run(kv, "a", 1)
    assert kv.num_prefix_pages == 1
    kv.ingest_request("b")
    assert kv.match_prefix("b", [1, 2, 3, 4, 5]) == 4


def test_pages_the_token_list_does_not_cover_wait() -> None:
    kv = make()
    tokens = [1, 2, 3, 4, 5, 6, 7]
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", 7)
    run(kv, "a", 1)  # 8 stored but the list has 7 tokens: page 2 not keyed yet
    assert kv.num_prefix_pages == 1
    tokens.append(8)
    run(kv, "a", 1)
    assert kv.num_prefix_pages == 2


def test_capture_steps_and_requests_without_tokens_are_not_indexed() -> None:
    kv = make()
    kv.ingest_request("pad")
    run(kv, "pad", 8)
    kv.ingest_request("a", KVRequestConfig(list(range(8))))
    run(kv, "a", 8, StepContext(request_ids=[], graph_walk="d", slot=0, capture=True))
    assert kv.num_prefix_pages == 0


def test_first_writer_wins_and_both_pages_are_conserved() -> None:
    kv = make()
    prompt = list(range(5))
    for rid in ("a", "b"):  # both prefill before either commits
        kv.ingest_request(rid, KVRequestConfig(prompt))
        assert kv.match_prefix(rid, prompt) == 0
    run(kv, "a", 5)
    run(kv, "b", 5)
    assert kv.num_prefix_pages == 1
    kv.remove_request("a")
    kv.remove_request("b")
    assert kv.num_free_pages == kv.num_pages - 1  # the index keeps a's page
    assert kv.evict_prefix_cache() == 1
    assert kv.num_free_pages == kv.num_pages


def test_index_keeps_pages_after_the_writer_is_gone() -> None:
    kv = make()
    prompt = list(range(9))
    prefill(kv, "a", prompt)
    a_pages = kv._streams["a"]["main"].pages[:2]
    kv.cache.tensor[0, a_pages[0]] = 3.0
    kv.remove_request("a")
    assert kv.num_free_pages == kv.num_pages - 2
    kv.ingest_request("b")
    assert kv.match_prefix("b", prompt) == 8
    assert kv._streams["b"]["main"].pages == a_pages
    assert torch.all(kv.cache.tensor[0, a_pages[0]] == 3.0)


def test_lru_leaf_eviction_order() -> None:
    kv = make()
    prefill(kv, "a", [1] * 9)  # chain a0 -> a1
    prefill(kv, "b", [2] * 5)  # chain b0
    kv.remove_request("a")
    kv.remove_request("b")
    kv.ingest_request("probe")
    assert kv.match_prefix("probe", [1] * 5) == 4  # touches a0 (a1 stays oldest)
    kv.remove_request("probe")
    # Leaves: a1 (oldest stamp), b0. Evicting one takes a1, then a0 becomes a leaf.
    assert kv.evict_prefix_cache(1) == 1
    kv.ingest_request("x")
    assert kv.match_prefix("x", [1] * 9) == 4
    kv.remove_request("x")
    assert kv.evict_prefix_cache(1) == 1  # b0 is older than the re-stamped a0
    kv.ingest_request("y")
    assert kv.match_prefix("y", [2] * 5) == 0
    kv.remove_request("y")
    assert kv.evict_prefix_cache() == 1
    assert kv.num_free_pages == kv.num_pages and kv.num_prefix_pages == 0


def test_pages_still_held_by_a_stream_are_not_evicted() -> None:
    kv = make()
    prefill(kv, "a", list(range(9)))
    assert kv.evict_prefix_cache() == 0
    assert kv.num_prefix_pages == 2


def test_admit_evicts_index_leaves_before_refusing() -> None:
    kv = make(num_pages=5)  # 4 usable
    prefill(kv, "a", list(range(9)))  # 3 pages, 2 indexed
    kv.remove_request("a")
    assert kv.num_free_pages == 2
    kv.ingest_request("b")
    run(kv, "b", 12)  # needs 3: evicts one leaf
    assert kv.num_prefix_pages == 1
    kv.ingest_request("c")
    out = kv.admit(ResourceStep(segments=(Segment("c", "main", 8),)), CTX)
    assert isinstance(out.reason, AllocationFailed)
    assert out.reason.pages_short == 1  # everything evictable was evicted first
    assert kv.num_prefix_pages == 0


def test_disabled_prefix_cache_matches_nothing() -> None:
    kv = make(prefix=False)
    prefill(kv, "a", list(range(9)))
    kv.ingest_request("b")
    assert kv.match_prefix("b", list(range(9))) == 0
    assert kv.prefix_queries == 18 and kv.prefix_hits == 0
    assert kv.evict_prefix_cache() == 0


def test_match_prefix_on_unknown_request_raises() -> None:
    kv = make()
    with pytest.raises(KeyError):
        kv.match_prefix("ghost", [1, 2])


def test_usage_counts_idle_cached_pages_as_free() -> None:
    kv = make(num_pages=9)  # 8 usable pages
    tokens = list(range(10, 22))  # 3 whole pages
    prefill(kv, "a", tokens)
    assert kv.usage == pytest.approx(3 / 8)
    prefill(kv, "b", tokens)  # shares 2 indexed pages, 1 page of its own
    assert kv.usage == pytest.approx(4 / 8)
    kv.remove_request("a")
    kv.remove_request("b")
    assert kv.num_prefix_pages == 3 and kv.num_cached_pages == 3
    assert kv.num_free_pages == 5 and kv.usage == 0.0


def test_large_index_stats_and_eviction_do_not_walk_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "0")  # the debug check walks everything
    n = 50_001
    kv = KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=1,
            num_pages=n + 1,
            page_size=1,
            max_seq_len=n,
            enable_prefix_cache=True,
        )
    )
    tokens = list(range(n))
    kv.ingest_request("a", KVRequestConfig(tokens))
    run(kv, "a", n)
    kv.remove_request("a")
    kv.ingest_request("b")
    assert kv.match_prefix("b", tokens[:10]) == 9  # 9 indexed pages busy again
    prefix = kv.prefix
    assert prefix is not None and len(prefix) == n
    entries = prefix._entries = CountingDict(prefix._entries)
    page_keys = prefix._page_keys = CountingDict(prefix._page_keys)

    assert kv.num_cached_pages == n - 9
    assert kv.usage == pytest.approx(9 / n)
    assert kv.num_free_pages == 0
    assert entries.walks == page_keys.walks == 0

    heap = prefix._leaves
    assert kv.evict_prefix_cache(1) == 1  # the chain's tail, the only idle leaf
    assert kv.evict_prefix_cache(1) == 1  # its parent, exposed by the first eviction
    assert entries.walks == page_keys.walks == 0
    assert entries.touches <= 6 and prefix._leaves is heap  # popped, not rebuilt
    assert kv.num_cached_pages == n - 11 and kv.num_free_pages == 2
    assert entries.walks == 0


def test_leaf_heap_stays_bounded_and_ordered_under_repeated_hits() -> None:
    kv = make()
    prefill(kv, "a", [1] * 5)  # leaf a0
    prefill(kv, "b", [2] * 5)  # leaf b0
    kv.remove_request("a")
    kv.remove_request("b")
    prefix = kv.prefix
    assert prefix is not None
    for i in range(300):  # each hit re-stamps b0, leaving a stale heap item behind
        kv.ingest_request(f"p{i}")
        assert kv.match_prefix(f"p{i}", [2] * 5) == 4
        kv.remove_request(f"p{i}")
        assert len(prefix._leaves) <= 2 * len(prefix) + 65
    assert kv.evict_prefix_cache(1) == 1  # a0: never hit, the oldest
    kv.ingest_request("q")
    assert kv.match_prefix("q", [2] * 5) == 4  # b0, hit last, stays
    kv.ingest_request("r")
    assert kv.match_prefix("r", [1] * 5) == 0
