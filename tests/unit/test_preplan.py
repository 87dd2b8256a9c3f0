"""Pre-planning one step ahead: the sampler promotes a stage only for exactly the step it was
made for, and the StepRunner clears every resource's stage when the real step differs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mstar.engine.batch import StepResult, next_decode_step
from mstar.engine.request import Request
from mstar.engine.resource_keys import ATTN, KV, ROPE, SAMPLER
from mstar.engine.resources.base import Resource
from mstar.engine.resources.kv import KVCacheResource, KVConfig, KVRequestConfig
from mstar.engine.resources.runner import StepRunner
from mstar.engine.resources.sampling import SampleOutput, SamplerRequestConfig, SamplerResource
from mstar.engine.resources.step import (
    BucketKey,
    ResourceStep,
    Segment,
    SlotLease,
    StepContext,
    SubmoduleStep,
)
from mstar.engine.sampling_params import SamplingParams
from mstar.engine.scheduler import Scheduler, SchedulerConfig

SEEDED = SamplingParams(temperature=0.9, seed=11)


def _sampler(*rids: str, params: SamplingParams = SEEDED) -> SamplerResource:
    res = SamplerResource(8)
    for rid in rids:
        res.ingest_request(rid, SamplerRequestConfig(params))
    return res


def _step(rids: Sequence[str], slot: int | None) -> tuple[ResourceStep, StepContext]:
    lease = None if slot is None else SlotLease(slot, None)
    ctx = StepContext(list(rids), "llm", slot or 0, False, slot_lease=lease)
    return ResourceStep(tuple(Segment(r, "main", 1) for r in rids)), ctx


def test_matching_stage_is_promoted_with_fresh_dynamic_keys() -> None:
    res = _sampler("a", "b")
    fresh = _sampler("a", "b")
    step, ctx = _step(["a", "b"], 1)
    res.pre_plan(step, ctx)
    # Step N commits between the pre-plan and the real plan: the seeded noise index advances.
    res.record("a", 3)
    fresh.record("a", 3)
    promoted = res.plan(step, ctx)
    assert res.promotions == 1
    expected = fresh.plan(*_step(["a", "b"], 1))
    assert promoted.seeded_keys is not None and expected.seeded_keys is not None
    assert torch.equal(promoted.seeded_keys, expected.seeded_keys)
    logits = torch.randn(2, 8)
    assert res.sample(promoted, logits).token_ids == fresh.sample(expected, logits).token_ids
    res.plan(step, ctx)  # a stage is used once
    assert res.promotions == 1


def test_stage_for_other_rows_slot_or_request_is_not_promoted() -> None:
    res = _sampler("a", "b")
    res.pre_plan(*_step(["a", "b"], 1))
    plan = res.plan(*_step(["a"], 1))  # a row finished
    assert res.promotions == 0 and plan.request_ids == ("a",)
    res.pre_plan(*_step(["a"], 0))
    res.plan(*_step(["a"], 1))  # another slot
    assert res.promotions == 0
    res.pre_plan(*_step(["a"], 1))
    res.remove_request("a")  # same id, a different request now
    res.ingest_request("a", SamplerRequestConfig(SamplingParams(temperature=0.0)))
    plan = res.plan(*_step(["a"], 1))
    assert res.promotions == 0 and plan.all_greedy
    res.pre_plan(*_step(["a"], 1))
    res.clear_preplan()
    res.plan(*_step(["a"], 1))
    assert res.promotions == 0


class _Staging(Resource):
    """A pre-planning resource that records its stage and whether it was cleared."""

    supports_preplan = True

    def __init__(self) -> None:
        self.staged: object = None
        self.cleared = 0

    def pre_plan(self, step: ResourceStep, ctx: StepContext) -> object:
        self.staged = step.segments
        return None

    def clear_preplan(self) -> None:
        self.staged = None
        self.cleared += 1


class _Plain(Resource):
    pass


def _submodule(rids: Sequence[str], slot: int) -> SubmoduleStep:
    segs = [Segment(r, "main", 1) for r in rids]
    step = SubmoduleStep(
        {"sampler": ResourceStep(), "x": ResourceStep(), "p": ResourceStep()}, segs
    )
    lease = SlotLease(slot, BucketKey("llm", 4, 4))
    step.set_ctx(StepContext(list(rids), "llm", slot, False, slot_lease=lease))
    return step


def test_runner_clears_every_resource_when_the_real_step_differs() -> None:
    sampler = _sampler("a", "b")
    staging, plain = _Staging(), _Plain()
    runner = StepRunner({"sampler": sampler, "x": staging, "p": plain})
    assert runner.preplan_order == ("sampler", "x")
    nxt = _submodule(["a", "b"], 1)
    nxt.ctx.is_preplan = True
    assert runner.pre_admit(nxt).ok
    runner.pre_plan(nxt)
    assert runner.staged is not None and staging.staged is not None
    real = _submodule(["b"], 1)  # "a" finished: the stage is for other rows
    assert runner.admit(real).ok
    assert runner.staged is None and staging.cleared == 1 and staging.staged is None
    runner.plan(real)
    assert sampler.promotions == 0


def test_runner_promotes_when_the_real_step_matches() -> None:
    sampler = _sampler("a", "b")
    staging = _Staging()
    runner = StepRunner({"sampler": sampler, "x": staging, "p": _Plain()})
    nxt = _submodule(["a", "b"], 0)
    nxt.ctx.is_preplan = True
    runner.pre_admit(nxt)
    runner.pre_plan(nxt)
    real = _submodule(["a", "b"], 0)
    runner.admit(real)
    runner.plan(real)
    assert staging.cleared == 0 and sampler.promotions == 1


def test_scheduler_predicts_only_a_batched_decode_and_predicts_it_exactly() -> None:
    kv = KVCacheResource(
        KVConfig(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=32, page_size=4)
    )
    resources = {KV: kv, ATTN: Resource(), ROPE: Resource(), SAMPLER: SamplerResource(200)}
    sched = Scheduler(StepRunner(resources), kv, SchedulerConfig(8, 64, hold_seconds=0.0))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((3, 6)):
        req = Request(f"r{i}", [10 * i + j for j in range(n)], params, float(i))
        req.overrides = {KV: KVRequestConfig(req.token_view)}
        sched.add(req)

    def run(batch):  # type: ignore[no-untyped-def]
        n = len(batch.sample_rows)
        sched.update(batch, StepResult(SampleOutput([7] * n, None, torch.full((n,), 7))))

    prefill = sched.schedule()
    assert prefill is not None and next_decode_step(prefill) is None  # prefill: no guess
    run(prefill)
    decode = sched.schedule()
    assert decode is not None
    guess = next_decode_step(decode)
    assert guess is not None
    run(decode)
    real = sched.schedule()
    assert real is not None
    assert [s for s in guess.segments or ()] == [s for s in real.step.segments or ()]
    assert guess.steps[SAMPLER].segments == real.step.steps[SAMPLER].segments
    assert [s.request_id for s in guess.segments or ()] == list(real.step.ctx.request_ids)
