"""Property-based: random admit/commit/remove/offload/reload/prefix sequences over a tiny pool.

The cache holds, for every token, K = its token id and V = its position. After every operation
pages must be conserved, and every resident stream must read back exactly its own tokens: this
catches a shared page being written, a reload putting bytes in the wrong place, or a prefix
match serving another prompt.

Copies run either inline (``async_copy=False``) or on the copy worker, which the machine keeps
paused: an offload or reload is only claimed by its rule, and lands when a `copy_lands` rule
lets the worker run one copy. In between, steps, removals (abort mid-copy), resets and
further offloads/reloads interleave freely; an armed failure makes the next copy raise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVPlan, KVRequestConfig
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


class InjectedCopyError(RuntimeError):
    pass


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tokens: dict[str, list[int]] = {}
        self.dead: set[str] = set()  # refused terminally: only removal left
        self.counter = 0
        self.failures_armed = 0

    def live(self) -> list[str]:
        return sorted(r for r in self.tokens if r not in self.dead)

    def pick(self, data: st.DataObject, prefer: Callable[[str], bool]) -> str:
        """A request, drawn from those ``prefer`` picks out about half of the time."""
        everyone = sorted(self.tokens)
        preferred = [r for r in everyone if prefer(r)]
        if preferred and data.draw(st.booleans(), label="preferred"):
            return data.draw(st.sampled_from(preferred))
        return data.draw(st.sampled_from(everyone))

    @initialize(
        prompts=st.lists(
            st.lists(st.integers(0, 1), min_size=1, max_size=9), min_size=1, max_size=3
        ),
        async_copy=st.sampled_from([True, True, True, False]),
    )
    def start(self, prompts: list[list[int]], async_copy: bool) -> None:
        self.async_copy = async_copy
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
                async_copy=async_copy,
            )
        )
        kv = self.kv
        kv.copier.pause()
        host = kv.host
        assert host is not None
        for name in ("copy_out", "copy_in"):
            setattr(host, name, self._failing(getattr(host, name)))
        for prompt in prompts:  # prefilled, so there is something to offload from the start
            self.new_request(prompt)
            rid = f"r{self.counter - 1}"
            step = ResourceStep(segments=(Segment(rid, "main", len(prompt) - kv.stored_len(rid)),))
            if kv.admit(step, CTX).ok:
                self._write(kv.plan(step, CTX), step.segments)
                kv.commit(step, CTX)

    def _failing(self, copy: Callable[..., None]) -> Callable[..., None]:
        def run(*args: Any) -> None:
            if self.failures_armed:
                self.failures_armed -= 1
                raise InjectedCopyError("injected copy failure")
            copy(*args)

        return run

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
                if self.kv.copy_in_flight(reason.request_id):
                    event("admit answered RequestOffloading mid-copy")
            else:
                too_long = [
                    s.request_id
                    for s in segs
                    if self.kv.stored_len(s.request_id) + s.span > min(MAX_LEN, USABLE * PS)
                ]
                assert too_long
                self.dead.update(too_long)
            return
        for rid in chosen:  # a step is in flight for each: offload must decline, moving nothing
            transit = self.kv.num_pages_in_transit
            assert self.kv.offload(rid) == 0 and not self.kv.is_offloaded(rid)
            assert self.kv.num_pages_in_transit == transit
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
        if data.draw(st.booleans(), label="forward fails") and data.draw(st.booleans()):
            # The forward failed: nothing advances, the reserved pages stay as a high-water mark.
            self.kv.abort_step(step, CTX)
            return
        self._write(plan, segs)
        self.kv.commit(step, CTX)

    def _write(self, plan: KVPlan, segs: Sequence[Segment]) -> None:
        """The forward: K = token id, V = position for every token of the step."""
        k = torch.tensor(
            [float(self.tokens[s.request_id][t]) for s in segs for t in self._span_positions(s)]
        ).view(-1, 1, 1)
        v = torch.tensor([float(t) for s in segs for t in self._span_positions(s)]).view(-1, 1, 1)
        self.kv.cache.write_tokens(0, k, v, plan.write_slots)

    def _span_positions(self, seg: Segment) -> range:
        stored = self.kv.stored_len(seg.request_id)
        return range(stored, stored + seg.span)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        rid = self.pick(data, self.kv.copy_in_flight)
        if self.kv.copy_in_flight(rid):
            event("removed mid-copy")
        self.kv.remove_request(rid)
        del self.tokens[rid]
        self.dead.discard(rid)
        assert self.kv.pages_held_by(rid) == 0

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        rid = self.pick(data, lambda r: self.kv.reclaimable(r) > 0)
        kv = self.kv
        expected = kv.reclaimable(rid)
        held = kv.pages_held_by(rid)
        transit = kv.num_pages_in_transit
        try:
            freed = kv.offload(rid)
        except InjectedCopyError:  # inline copy failed: the claim was undone
            event("inline offload failed, undone")
            assert not self.async_copy and expected > 0
            assert not kv.is_offloaded(rid) and not kv.copy_in_flight(rid)
            assert kv.pages_held_by(rid) == held and kv.num_pages_in_transit == transit
            return
        assert freed in (0, expected)
        if not freed:
            assert kv.num_pages_in_transit == transit
            return
        assert kv.is_offloaded(rid) and kv.reclaimable(rid) == 0
        if self.async_copy:  # claimed: pages still held until the copy lands
            event("offload claimed")
            assert kv.copy_in_flight(rid) and kv.pages_held_by(rid) == held
            assert kv.num_pages_in_transit == transit + freed
        else:
            assert not kv.copy_in_flight(rid) and kv.pages_held_by(rid) == 0

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def reload(self, data: st.DataObject) -> None:
        rid = self.pick(data, self.kv.is_offloaded)
        kv = self.kv
        free = kv.num_free_pages
        host = kv.num_host_pages_used
        was = kv.is_offloaded(rid)
        moving = kv.copy_in_flight(rid)
        try:
            ok = kv.reload(rid)
        except InjectedCopyError:  # inline copy failed: still offloaded, device pages back
            event("inline reload failed, undone")
            assert not self.async_copy and was
            assert kv.is_offloaded(rid) and kv.num_host_pages_used == host
            assert kv.pages_held_by(rid) == 0
            return
        if not ok:
            assert was and kv.is_offloaded(rid)
            assert kv.num_host_pages_used == host
            assert kv.num_free_pages >= free  # at most index leaves were evicted
        elif not was:
            assert not kv.is_offloaded(rid) and not moving
        elif self.async_copy:  # on its way: still offloaded until it lands
            event("reload claimed" if not moving else "reload while a copy is in flight")
            assert kv.is_offloaded(rid) and kv.copy_in_flight(rid)
        else:
            assert not kv.is_offloaded(rid) and kv.num_host_pages_used <= host

    @precondition(lambda self: self.async_copy and self.kv.copier.num_pending > 0)
    @rule(everything=st.booleans())
    def copy_lands(self, everything: bool) -> None:
        """Let the worker run the oldest claimed copy (or all of them), then pause it again."""
        copier = self.kv.copier
        pending = copier.num_pending
        failures = self.kv.copy_failures
        assert copier.step(pending if everything else 1) == (pending if everything else 1)
        assert copier.num_pending == (0 if everything else pending - 1)
        event("copy landed" if self.kv.copy_failures == failures else "copy failed, undone")

    @precondition(lambda self: self.failures_armed == 0)
    @rule()
    def arm_copy_failure(self) -> None:
        self.failures_armed = 1

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), free=st.booleans(), rematch=st.booleans())
    def reset(self, data: st.DataObject, free: bool, rematch: bool) -> None:
        """Recompute: the request keeps its tokens, its KV is gone (free) or rewound (not)."""
        rid = self.pick(data, self.kv.copy_in_flight)
        kv = self.kv
        if kv.copy_in_flight(rid):
            event("reset mid-copy")
        kv.reset_request(rid, free=free)
        assert kv.has_request(rid) and kv.stored_len(rid) == 0
        assert not kv.is_offloaded(rid) and not kv.copy_in_flight(rid)
        if free:
            assert kv.pages_held_by(rid) == 0
        if rematch:
            tokens = self.tokens[rid]
            matched = kv.match_prefix(rid, tokens)
            assert matched % PS == 0 and matched <= len(tokens) - 1
            assert kv.stored_len(rid) == matched

    @rule(n=st.integers(1, 3))
    def evict(self, n: int) -> None:
        self.kv.evict_prefix_cache(n)

    @invariant()
    def conserved_and_readable(self) -> None:
        kv = self.kv
        kv.assert_pages_conserved()
        assert kv.num_pages_in_transit >= 0
        assert kv.num_free_pages + kv.num_cached_pages + kv.num_pages_in_transit <= kv.num_pages
        for rid in self.tokens:
            assert not kv.copy_in_flight(rid) or kv.is_offloaded(rid)
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
        kv = getattr(self, "kv", None)
        if kv is None:
            return
        kv.copier.resume()
        kv.wait_copies(timeout=30)
        assert kv.num_pages_in_transit == 0
        assert not any(kv.copy_in_flight(rid) for rid in self.tokens)
        kv.assert_pages_conserved()
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
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


TestKVMachine = KVMachine.TestCase
