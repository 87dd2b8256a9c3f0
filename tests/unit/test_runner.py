"""StepRunner: ordering, failure naming, plan-result hand-off, pre-plan staging, sweeps."""

from __future__ import annotations

from typing import Any

import pytest

from mstar.engine.resources.base import Resource
from mstar.engine.resources.runner import StepRunner, topo_order
from mstar.engine.resources.step import (
    ADMIT_OK,
    FULL_ADMIT_OK,
    AdmitOutcome,
    AdmitRuntimeError,
    AllocationFailed,
    ResourceStep,
    Segment,
    StepContext,
    SubmoduleStep,
)


class Recorder(Resource):
    """A resource that records every call into a shared log and answers as told."""

    def __init__(
        self,
        name: str,
        log: list[tuple[str, str]],
        deps: set[str] | None = None,
        answer: AdmitOutcome = ADMIT_OK,
        preplan: bool = False,
    ) -> None:
        self.name, self.log, self.deps, self.answer = name, log, deps or set(), answer
        self.supports_preplan = preplan
        self.seen_plan_results: dict[str, Any] = {}
        self.cleared = 0

    def depends_on(self) -> set[str]:
        return self.deps

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        self.log.append(("admit", self.name))
        return self.answer

    def plan(self, step: ResourceStep, ctx: StepContext) -> Any:
        self.log.append(("plan", self.name))
        self.seen_plan_results = dict(ctx.plan_results)
        return f"plan:{self.name}"

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        self.log.append(("commit", self.name))

    def clear_preplan(self) -> None:
        self.cleared += 1


def _step(keys: list[str], rids: tuple[str, ...] = ("a",)) -> SubmoduleStep:
    segs = [Segment(r, "main", 1) for r in rids]
    step = SubmoduleStep({k: ResourceStep() for k in keys}, segments=segs)
    step.set_ctx(StepContext(list(rids), "decode", 0, False))
    return step


def test_topo_order_dependencies_first_ties_alphabetical() -> None:
    log: list = []
    res = {
        "sampler": Recorder("sampler", log),
        "attn": Recorder("attn", log, {"kv"}),
        "rope": Recorder("rope", log, {"kv"}),
        "kv": Recorder("kv", log),
        "z": Recorder("z", log, {"attn"}),
    }
    assert topo_order(res) == ("kv", "sampler", "attn", "rope", "z")


@pytest.mark.parametrize(
    ("deps", "message"),
    [
        ({"a": {"a"}}, "depends on itself"),
        ({"a": {"nope"}}, "unknown key"),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, "dependency cycle"),
    ],
)
def test_topo_order_errors(deps: dict[str, set[str]], message: str) -> None:
    log: list = []
    res = {k: Recorder(k, log, d) for k, d in deps.items()}
    res.setdefault("b", Recorder("b", log))
    with pytest.raises(ValueError, match=message):
        StepRunner(res)


def test_admit_plan_commit_in_topo_order_and_undeclared_skipped() -> None:
    log: list = []
    res = {
        "attn": Recorder("attn", log, {"kv"}),
        "kv": Recorder("kv", log),
        "extra": Recorder("extra", log),
    }
    runner = StepRunner(res)
    step = _step(["attn", "kv"])
    assert runner.admit(step) is FULL_ADMIT_OK
    results = runner.plan(step)
    runner.commit(step)
    assert log == [
        ("admit", "kv"),
        ("admit", "attn"),
        ("plan", "kv"),
        ("plan", "attn"),
        ("commit", "kv"),
        ("commit", "attn"),
    ]
    assert results is step.ctx.plan_results
    assert results == {"kv": "plan:kv", "attn": "plan:attn"}
    assert res["kv"].seen_plan_results == {}
    assert res["attn"].seen_plan_results == {"kv": "plan:kv"}


def test_stale_plan_results_cleared_on_reused_context() -> None:
    log: list = []
    runner = StepRunner({"kv": Recorder("kv", log)})
    step = _step(["kv"])
    step.ctx.plan_results["old"] = 1
    assert runner.plan(step) == {"kv": "plan:kv"}


def test_admit_short_circuits_and_names_failed_resource() -> None:
    log: list = []
    reason = AllocationFailed("short", 2, "main", "a")
    res = {
        "kv": Recorder("kv", log, answer=AdmitOutcome(False, True, reason)),
        "attn": Recorder("attn", log, {"kv"}),
    }
    out = StepRunner(res).admit(_step(["kv", "attn"]))
    assert not out.ok and out.failed_resource == "kv" and out.reason is reason
    assert log == [("admit", "kv")]


def test_a_refusal_after_an_admitted_resource_is_named() -> None:
    log: list = []
    err = AdmitRuntimeError("never fits")
    res = {
        "a": Recorder("a", log),
        "b": Recorder("b", log, answer=AdmitOutcome(False, True, err)),
    }
    out = StepRunner(res).admit(_step(["a", "b"]))
    assert out.failed_resource == "b" and out.reason is err
    assert StepRunner({"a": Recorder("a", log)}).admit(_step(["a"])) is FULL_ADMIT_OK


def test_unknown_key_in_step_raises_key_error() -> None:
    runner = StepRunner({"kv": Recorder("kv", [])})
    with pytest.raises(KeyError, match="does not have"):
        runner.admit(_step(["kv", "attn"]))


def test_preplan_dependency_on_non_preplanner_rejected() -> None:
    log: list = []
    res = {"kv": Recorder("kv", log), "attn": Recorder("attn", log, {"kv"}, preplan=True)}
    with pytest.raises(ValueError, match="pre-plans but depends on kv"):
        StepRunner(res)


def test_preplan_promotes_only_its_own_step() -> None:
    log: list = []
    res = {
        "kv": Recorder("kv", log, preplan=True),
        "attn": Recorder("attn", log, {"kv"}, preplan=True),
        "sampler": Recorder("sampler", log),
    }
    runner = StepRunner(res)
    staged = _step(["kv", "attn", "sampler"], ("a", "b"))
    staged.ctx.is_preplan = True
    assert runner.pre_admit(staged).ok
    runner.pre_plan(staged)
    assert ("plan", "sampler") not in log  # sampler does not pre-plan
    assert runner.staged is not None

    same = _step(["kv", "attn", "sampler"], ("a", "b"))
    runner.admit(same)
    runner.plan(same)
    assert all(r.cleared == 0 for r in res.values())
    assert runner.staged is None  # consumed once

    runner.pre_plan(staged)
    foreign = _step(["kv", "attn", "sampler"], ("a", "c"))
    runner.admit(foreign)
    assert all(r.cleared == 1 for r in res.values())  # every resource, all or nothing


def test_ingest_routes_overrides_by_key() -> None:
    got: dict[str, Any] = {}

    class Ingest(Resource):
        def __init__(self, key: str) -> None:
            self.key = key

        def ingest_request(self, request_id: str, overrides: Any | None = None) -> None:
            got[self.key] = overrides

    runner = StepRunner({"kv": Ingest("kv"), "sampler": Ingest("sampler")})
    runner.ingest_request("r", {"kv": "cfg"})
    assert got == {"kv": "cfg", "sampler": None}


def test_build_cuda_graph_buffers_reaches_every_resource_in_order() -> None:
    seen: list[str] = []

    class Buf(Resource):
        def __init__(self, key: str) -> None:
            self.key = key

        def build_cuda_graph_buffers(self, slots, max_bs, max_seq_len):  # type: ignore[no-untyped-def]
            seen.append(self.key)

    runner = StepRunner({"b": Buf("b"), "a": Buf("a")})
    runner.build_cuda_graph_buffers([], 8, 128)
    assert seen == ["a", "b"]


def test_abort_step_reaches_every_resource_past_a_raise() -> None:
    hit: list[str] = []

    class Abort(Resource):
        def __init__(self, key: str, boom: bool) -> None:
            self.key, self.boom = key, boom

        def abort_step(self, step: ResourceStep, ctx: StepContext) -> None:
            hit.append(self.key)
            if self.boom:
                raise RuntimeError("boom")

    runner = StepRunner({"a": Abort("a", True), "b": Abort("b", False)})
    with pytest.raises(RuntimeError, match="boom"):
        runner.abort_step(_step(["a", "b"]))
    assert hit == ["a", "b"]


def test_eviction_helpers_scope_to_keys() -> None:
    class Evict(Resource):
        supports_eviction = True

        def __init__(self, pages: int) -> None:
            self.pages, self.off = pages, False

        def reclaimable(self, request_id: str) -> int:
            return 0 if self.off else self.pages

        def offload(self, request_id: str) -> int:
            self.off = True
            return self.pages

        def is_offloaded(self, request_id: str) -> bool:
            return self.off

        def reload(self, request_id: str) -> bool:
            self.off = False
            return True

    kv, other = Evict(3), Evict(5)
    runner = StepRunner({"kv": kv, "other": other, "noop": Resource()})
    assert runner.reclaimable("r", ["kv"]) == 3
    assert runner.reclaimable("r") == 8
    assert runner.offload("r", ["kv"]) == 3
    assert runner.is_offloaded("r") and not other.off
    assert runner.reload("r") and not kv.off
