"""Scheduler over a real StepRunner and KV cache (no model: each step "samples" a fixed token).

Admission without storms: new arrivals never evict, victims are never inside their protection
window, repeatedly evicted requests are protected, reloads are FCFS and come before new
admissions, and an abort in any state frees every page (conservation checks on).
"""

from __future__ import annotations

import pytest
import torch

from mstar.engine.batch import StepResult
from mstar.engine.outputs import FinishReason, RequestOutput
from mstar.engine.request import Request, RequestStatus
from mstar.engine.resource_keys import ATTN, KV, ROPE, SAMPLER
from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SampleOutput, SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import (
    ADMIT_OK,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ResourceStep,
    StepContext,
)
from mstar.engine.sampling_params import SamplingParams
from mstar.engine.scheduler import Scheduler, SchedulerConfig

PS = 4
TOKEN = 5


def make(
    usable_pages: int,
    host_pages: int = 0,
    *,
    hold: float = 0.0,
    budget: int = 256,
    max_seqs: int = 16,
    max_evictions: int = 2,
    policy: str = "lru",
) -> Scheduler:
    kv = KVCacheResource(
        KVConfig(
            num_layers=1,
            num_kv_heads=1,
            head_dim=4,
            num_pages=usable_pages + 1,  # + the sink page
            page_size=PS,
            host_offload_pages=host_pages,
            enable_prefix_cache=True,
            # Copies land inline: which step an offload lands in decides the next eviction,
            # and a copy thread made that depend on the host's load (one CI failure).
            async_copy=False,
        )
    )
    resources = {KV: kv, ATTN: Resource(), ROPE: Resource(), SAMPLER: SamplerResource(16)}
    config = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        eviction_policy=policy,
        hold_seconds=hold,
        max_evictions=max_evictions,
        watermark=0.0,  # exactly one page (the minimum) kept free for admissions
    )
    return Scheduler(StepRunner(resources), kv, config)


def kv_of(sched: Scheduler) -> KVCacheResource:
    kv = sched.runner.resources[KV]
    assert isinstance(kv, KVCacheResource)
    return kv


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 64) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    base = 100 * (1 + len(sched.requests))  # distinct prompts: no accidental prefix sharing
    req = Request(rid, [base + i for i in range(prompt_len)], params, float(len(sched.requests)))
    req.overrides = {
        KV: KVRequestConfig(req.token_view),
        SAMPLER: SamplerRequestConfig(params, req.prompt_token_ids),
    }
    sched.add(req)
    return req


def step(sched: Scheduler) -> tuple[list[str], list[RequestOutput]]:
    """One schedule -> (pretend) execute -> update; the ids that ran, and the outputs."""
    batch = sched.schedule()
    result = None
    if batch is not None:
        n = len(batch.sample_rows)
        sampled = SampleOutput([TOKEN] * n, None, torch.full((n,), TOKEN))
        result = StepResult(sampled)
    outs = sched.update(batch, result)
    return ([r.request.request_id for r in batch.rows] if batch else []), outs


def assert_nothing_held(sched: Scheduler) -> None:
    kv_of(sched).wait_copies()
    kv_of(sched).assert_pages_conserved()
    assert kv_of(sched).num_host_pages_used == 0
    for req in sched.requests.values():
        assert kv_of(sched).pages_held_by(req.request_id) == 0


def test_running_first_then_waiting_fcfs_with_last_prefill_chunked() -> None:
    sched = make(64, budget=10)
    c = add(sched, "c", 4)
    step(sched)  # c prefilled and running: decodes one token a step from now on
    add(sched, "a", 5)
    add(sched, "b", 6)
    batch = sched.schedule()
    assert batch is not None
    assert [(r.request.request_id, r.num_tokens) for r in batch.rows] == [
        ("c", 1),
        ("a", 5),
        ("b", 4),
    ]
    assert c.status is RequestStatus.RUNNING


def test_a_new_arrival_never_evicts_a_running_request() -> None:
    sched = make(8, host_pages=8)
    a = add(sched, "a", 12, max_tokens=4)  # 3 pages, grows into a 4th: 8 pages in all
    b = add(sched, "b", 12, max_tokens=4)
    step(sched)
    assert a.status is b.status is RequestStatus.RUNNING
    c = add(sched, "c", 8, max_tokens=2)  # needs 2 pages; at most 1 is free beyond the watermark
    ran: list[list[str]] = []
    while "c" not in {rid for ids in ran for rid in ids}:
        ids, _ = step(sched)
        ran.append(ids)
        assert sched.counters.evictions == 0
        if "c" not in ids:
            assert c.status is RequestStatus.WAITING and kv_of(sched).pages_held_by("c") == 0
    assert a.finished and b.finished  # c got pages only once a running request gave them back
    while sched.has_unfinished:
        step(sched)
    assert sched.counters.evictions == 0
    assert_nothing_held(sched)


def _three_running(sched: Scheduler) -> tuple[Request, Request, Request]:
    """a and b (2 pages each, admitted long ago) and c (1 page, admitted just now) run in an
    8-page pool; within a few steps a and b both need a fourth page and one must be evicted."""
    a = add(sched, "a", 8, max_tokens=12)  # up to 19 tokens: 5 pages
    b = add(sched, "b", 8, max_tokens=12)
    step(sched)
    a.protected_until = b.protected_until = 0.0
    c = add(sched, "c", 4, max_tokens=8)  # up to 11 tokens: 3 pages
    ids, _ = step(sched)
    assert ids == ["a", "b", "c"] and c.protected_until > 0
    return a, b, c


def test_growth_evicts_a_victim_outside_its_protection_window() -> None:
    sched = make(8, host_pages=8, hold=60.0)
    a, b, c = _three_running(sched)
    for _ in range(4):
        step(sched)
    assert sched.counters.evictions == 1
    assert c.status is RequestStatus.RUNNING and c.num_evictions == 0  # the newest, but protected
    # LRU ties (a and b ran in the same steps) go to the newest arrival outside protection: b.
    assert b.status is RequestStatus.OFFLOADED and b.num_evictions == 1
    assert a.status is RequestStatus.RUNNING and a.num_evictions == 0
    for rid in ("a", "b", "c"):
        sched.abort(rid)
    step(sched)
    assert_nothing_held(sched)


def test_a_repeatedly_evicted_request_is_protected_so_it_finishes() -> None:
    sched = make(8, host_pages=8, hold=60.0, max_evictions=1)
    a, b, _ = _three_running(sched)
    b.num_evictions = 1  # evicted before: b would be the LRU victim without the protection
    for _ in range(4):
        step(sched)
    assert sched.counters.evictions == 1
    assert b.num_evictions == 1 and b.status is RequestStatus.RUNNING
    assert a.num_evictions == 1 and a.status is RequestStatus.OFFLOADED
    while b.status is RequestStatus.RUNNING:
        step(sched)
    assert b.finished and b.num_output_tokens == 12 and sched.counters.evictions == 1
    for rid in ("a", "c"):
        sched.abort(rid)
    step(sched)
    assert_nothing_held(sched)


def test_reloads_are_fcfs_and_come_before_new_admissions() -> None:
    sched = make(16, host_pages=16)
    x = add(sched, "x", 8, max_tokens=40)
    y = add(sched, "y", 8, max_tokens=40)
    r = add(sched, "r", 20, max_tokens=3)
    step(sched)
    for req in (x, y):  # evict both, oldest first in the queue
        assert sched.runner.offload(req.request_id) > 0
    kv_of(sched).wait_copies()
    step(sched)  # their admits meet offloaded streams: both parked as offloaded
    assert x.status is y.status is RequestStatus.OFFLOADED
    assert [q.request_id for q in sched.offloaded] == ["x", "y"]
    z = add(sched, "z", 8, max_tokens=2)
    order: list[str] = []
    while z.status is RequestStatus.WAITING:
        before = {q.request_id for q in sched.offloaded}
        step(sched)
        kv_of(sched).wait_copies()
        order += sorted(before - {q.request_id for q in sched.offloaded})
        if z.status is not RequestStatus.WAITING:
            assert not sched.offloaded  # z was admitted only after every reload
    assert order == ["x", "y"]
    assert sched.counters.reloads == 2
    while sched.has_unfinished:
        step(sched)
    assert r.finished and z.finished
    assert_nothing_held(sched)


def test_without_host_room_the_victim_is_recomputed_in_every_resource() -> None:
    sched = make(6, host_pages=0)
    a = add(sched, "a", 8, max_tokens=10)
    b = add(sched, "b", 8, max_tokens=10)
    step(sched)
    a.protected_until = b.protected_until = 0.0
    outs: dict[str, list[int]] = {"a": [], "b": []}
    while sched.has_unfinished:
        _, out = step(sched)
        for o in out:
            outs[o.request_id].extend(o.new_token_ids)
    assert sched.counters.recomputations >= 1 and sched.counters.offloads == 0
    assert outs == {"a": [TOKEN] * 9, "b": [TOKEN] * 9}  # first token came in the first step
    assert_nothing_held(sched)


@pytest.mark.parametrize("state", ["waiting", "running", "offloaded"])
def test_abort_in_every_state_frees_every_page(state: str) -> None:
    sched = make(16, host_pages=16)
    a = add(sched, "a", 9)
    b = add(sched, "b", 5)
    if state != "waiting":
        step(sched)
        step(sched)
    if state == "offloaded":
        assert sched.runner.offload("a") > 0
        kv_of(sched).wait_copies()
        step(sched)
        assert kv_of(sched).num_host_pages_used > 0
    assert a.status is RequestStatus(state)
    sched.abort("a")
    _, outs = step(sched)
    assert [o.finish_reason for o in outs if o.request_id == "a"] == [FinishReason.ABORT]
    assert "a" not in sched.requests and kv_of(sched).pages_held_by("a") == 0
    sched.abort("b")
    step(sched)
    assert b.finished and not sched.requests
    assert_nothing_held(sched)


class _RefuseOnce(Resource):
    """Answers AllocationFailed for `rid`'s first admit (as a resource short of capacity would)."""

    def __init__(self, rid: str) -> None:
        self.rid, self.left = rid, 1

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        if self.left and self.rid in ctx.request_ids:
            self.left -= 1
            return AdmitOutcome(False, True, AllocationFailed("short", 1, "main", self.rid))
        return ADMIT_OK


def test_a_refused_new_arrival_is_dropped_holding_nothing_and_evicts_nobody() -> None:
    sched = make(32, host_pages=8)
    a = add(sched, "a", 8)
    step(sched)
    gate = _RefuseOnce("c")
    sched.runner = StepRunner({**sched.runner.resources, ATTN: gate})
    shared = list(a.prompt_token_ids)  # c shares a's prefix: it matches pages before admit
    c = add(sched, "c", 4)
    c._tokens[:] = [*shared, 1, 2, 3, 4]
    c.prompt_token_ids = list(c._tokens)
    ids, outs = step(sched)
    assert ids == ["a"] and gate.left == 0  # a went on in the same step
    refused = [e.attributes["reason"] for o in outs if o.request_id == "c" for e in o.events]
    assert refused == ["AllocationFailed"]
    assert c.status is RequestStatus.WAITING and kv_of(sched).pages_held_by("c") == 0
    assert sched.counters.evictions == 0
    ids, _ = step(sched)
    assert "c" in ids and c.num_cached_tokens == 8  # admitted next step, prefix reused
    for rid in ("a", "c"):
        sched.abort(rid)
    step(sched)
    assert_nothing_held(sched)


class _CountAdmits(StepRunner):
    """A real StepRunner that records the rows of every step it is asked to admit."""

    def __init__(self, resources: dict[str, Resource]) -> None:
        super().__init__(resources)
        self.admitted: list[list[str]] = []

    def admit(self, step):  # type: ignore[no-untyped-def]
        self.admitted.append([s.request_id for s in step.segments or ()])
        return super().admit(step)


class _RejectWithoutName(Resource):
    """Refuses request `rid` for good with the seed's class, which names no request."""

    def __init__(self, rid: str) -> None:
        self.rid = rid

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        if self.rid in [s.request_id for s in step.segments or ()]:
            return AdmitOutcome(False, True, AdmitRuntimeError("never, and I do not say whom"))
        return ADMIT_OK


def _failed(outs: list[RequestOutput]) -> dict[str, str]:
    return {o.request_id: o.error.message for o in outs if o.error is not None}


def test_a_terminal_refusal_names_its_request_and_fails_only_it_in_one_retry() -> None:
    sched = make(8)
    sched.runner = runner = _CountAdmits(dict(sched.runner.resources))
    add(sched, "small", 4)
    add(sched, "huge", 40)  # 10 pages: more than the whole pool of 8
    ids, outs = step(sched)
    assert ids == ["small"]
    # One refusal (it names "huge"), one retry without it: no row is re-admitted alone.
    assert runner.admitted == [["small", "huge"], ["small"]]
    assert list(_failed(outs)) == ["huge"] and "needs 10 KV pages" in _failed(outs)["huge"]
    refusals = [e.attributes for o in outs for e in o.events if e.name == "admit_refused"]
    assert [(r["reason"], r["resource"]) for r in refusals] == [("AdmitRuntimeError", "kv")]


def test_a_nameless_terminal_refusal_is_found_by_admitting_rows_alone() -> None:
    sched = make(32)
    resources = dict(sched.runner.resources)
    resources[ATTN] = _RejectWithoutName("b")
    sched.runner = runner = _CountAdmits(resources)
    for rid in ("a", "b", "c"):
        add(sched, rid, 4)
    ids, outs = step(sched)
    assert runner.admitted == [["a", "b", "c"], ["a"], ["b"], ["a", "c"]]
    assert ids == ["a", "c"] and list(_failed(outs)) == ["b"]
    kv_of(sched).assert_pages_conserved()
    assert "b" not in sched.requests and kv_of(sched).pages_held_by("b") == 0
