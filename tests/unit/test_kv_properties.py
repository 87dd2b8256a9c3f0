"""Property-based: random admit/commit/remove/offload/reload/prefix sequences over a tiny pool.

The cache holds, for every token, K = its token id and V = its position. After every operation
pages must be conserved, and every resident stream must read back exactly its own tokens: this
catches a shared page being written, a reload putting bytes in the wrong place, or a prefix
match serving another prompt.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.step import (
    AdmitRuntimeError,
    AllocationFailed,
    RequestOffloading,
    ResourceStep,
    Segment,
    StepContext,
)

PS = 2
USABLE = 6
MAX_LEN = 14
CTX = StepContext(request_ids=[], graph_walk="mixed", slot=0, capture=False)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheResource(
            KVConfig(
                num_layers=1,
                num_kv_heads=1,
                head_dim=1,
                num_pages=USABLE + 1,
                page_size=PS,
                max_seq_len=MAX_LEN,
                host_offload_pages=5,
                enable_prefix_cache=True,
            )
        )
        self.tokens: dict[str, list[int]] = {}
        self.dead: set[str] = set()  # refused terminally: only removal left
        self.counter = 0

    def live(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.dead)

    @initialize(prompts=st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=9), max_size=3))
    def start(self, prompts: list[list[int]]) -> None:
        for prompt in prompts:
            self.new_request(prompt)

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=15))
    def new_request(self, prompt: list[int]) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        tokens = list(prompt)
        self.tokens[rid] = tokens
        self.kv.ingest_request(rid, KVRequestConfig(tokens))
        self.kv.ingest_request(rid, KVRequestConfig(tokens))  # idempotent
        matched = self.kv.match_prefix(rid, tokens)
        assert matched % PS == 0 and matched <= len(tokens) - 1
        assert self.kv.stored_len(rid) == matched

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self._step(data)

    @precondition(lambda self: bool(self.live()))
    @rule(data=st.data())
    def another_step(self, data: st.DataObject) -> None:
        """A second copy of `step`, so steps are drawn about twice as often as other rules."""
        self._step(data)

    def _step(self, data: st.DataObject) -> None:
        live = self.live()
        chosen = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        segs = []
        for rid in chosen:
            tokens = self.tokens[rid]
            stored = self.kv.stored_len(rid)
            if stored == len(tokens):  # decode: the sampled token joins the list first
                tokens.append(data.draw(st.integers(0, 1)))
            span = data.draw(st.integers(0, len(tokens) - stored))
            segs.append(Segment(rid, "main", span))
        step = ResourceStep(segments=tuple(segs))
        held = {rid: self.kv.pages_held_by(rid) for rid in chosen}
        out = self.kv.admit(step, CTX)
        if not out.ok:
            reason = out.reason
            assert isinstance(reason, AllocationFailed | RequestOffloading | AdmitRuntimeError)
            assert {rid: self.kv.pages_held_by(rid) for rid in chosen} == held
            if isinstance(reason, AllocationFailed):
                assert reason.pages_short > 0 and reason.request_id in chosen
            elif isinstance(reason, RequestOffloading):
                assert self.kv.is_offloaded(reason.request_id)
            else:
                too_long = [
                    s.request_id
                    for s in segs
                    if self.kv.stored_len(s.request_id) + s.span > min(MAX_LEN, USABLE * PS)
                ]
                assert too_long
                self.dead.update(too_long)
            return
        plan = self.kv.plan(step, CTX)
        owners = self.kv.arena.owners
        for slot in plan.write_slots.tolist():
            assert owners[slot // PS] == 1, "a shared page is about to be written"
        assert plan.num_tokens == sum(s.span for s in segs)
        seq_lens = plan.seq_lens.tolist()
        counts = [b - a for a, b in itertools.pairwise(plan.kv_indptr.tolist())]
        assert counts == [-(-n // PS) for n in seq_lens]  # sliced to the length, never the mark
        assert len(plan.kv_indices) == sum(counts)
        assert all(
            n == 0 or n - (c - 1) * PS == last
            for n, c, last in zip(seq_lens, counts, plan.kv_last_page_len.tolist(), strict=True)
        )
        assert plan.seq_lens.tolist() == [
            p + s.span for p, s in zip(plan.prefix_lens.tolist(), segs, strict=True)
        ]
        k = torch.tensor(
            [float(self.tokens[s.request_id][t]) for s in segs for t in self._span_positions(s)]
        ).view(-1, 1, 1)
        v = torch.tensor([float(t) for s in segs for t in self._span_positions(s)]).view(-1, 1, 1)
        if data.draw(st.booleans(), label="forward fails") and data.draw(st.booleans()):
            # The forward failed: nothing advances, the reserved pages stay as a high-water mark.
            self.kv.abort_step(step, CTX)
            return
        self.kv.cache.write_tokens(0, k, v, plan.write_slots)
        self.kv.commit(step, CTX)

    def _span_positions(self, seg: Segment) -> range:
        stored = self.kv.stored_len(seg.request_id)
        return range(stored, stored + seg.span)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.remove_request(rid)
        del self.tokens[rid]
        self.dead.discard(rid)
        assert self.kv.pages_held_by(rid) == 0

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        expected = self.kv.reclaimable(rid)
        freed = self.kv.offload(rid)
        assert freed in (0, expected)
        if freed:
            assert self.kv.is_offloaded(rid) and self.kv.pages_held_by(rid) == 0

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def reload(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        free = self.kv.num_free_pages
        host = self.kv.num_host_pages_used
        was = self.kv.is_offloaded(rid)
        ok = self.kv.reload(rid)
        if not ok:
            assert was and self.kv.is_offloaded(rid)
            assert self.kv.num_host_pages_used == host
            assert self.kv.num_free_pages >= free  # at most index leaves were evicted
        else:
            assert not self.kv.is_offloaded(rid)

    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        self.kv.evict_prefix_cache(n)

    @invariant()
    def conserved_and_readable(self) -> None:
        self.kv.assert_pages_conserved()
        for rid, tokens in self.tokens.items():
            if self.kv.is_offloaded(rid):
                continue
            stored = self.kv.stored_len(rid)
            if not stored:
                continue
            plan = self.kv.plan(ResourceStep(segments=(Segment(rid, "main", 0),)), CTX)
            pages = plan.kv_indices.tolist()
            slots = torch.tensor([pages[t // PS] * PS + t % PS for t in range(stored)])
            k, v = self.kv.cache.read_tokens(0, slots)
            assert k.flatten().tolist() == [float(x) for x in tokens[:stored]], rid
            assert v.flatten().tolist() == [float(t) for t in range(stored)], rid

    def teardown(self) -> None:
        kv = self.kv
        for rid in list(self.tokens):
            kv.remove_request(rid)
        kv.assert_pages_conserved()
        assert kv.num_host_pages_used == 0
        index_pages = set(kv.prefix.pages()) if kv.prefix is not None else set()
        assert kv.num_free_pages == kv.num_pages - len(index_pages)
        assert all(kv.arena.owners[p] == 1 for p in index_pages)
        kv.evict_prefix_cache()
        assert kv.num_free_pages == kv.num_pages and kv.num_prefix_pages == 0
        kv.assert_pages_conserved()


KVMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.fixture(autouse=True)
def _debug_asserts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MSTAR_KV_DEBUG_ASSERTS", "1")


TestKVMachine = KVMachine.TestCase
