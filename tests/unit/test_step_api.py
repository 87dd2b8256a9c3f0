"""The seed API of mstar.engine.resources.step, pinned field by field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from mstar.engine.resources import step as S


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and hasattr(cls, "_fields")


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (S.Segment, ("request_id", "label", "span")),
        (S.AdmitOutcome, ("ok", "ready", "reason")),
        (S.FullAdmitOutcome, ("outcome", "failed_resource")),
    ],
)
def test_hot_values_are_namedtuples_with_seed_field_order(cls: type, fields: tuple) -> None:
    assert _is_namedtuple(cls)
    assert cls._fields == fields  # type: ignore[attr-defined]
    assert not dataclasses.is_dataclass(cls)


@pytest.mark.parametrize(
    ("cls", "fields"),
    [
        (S.AdmitFailedReason, ("message",)),
        (S.AllocationFailed, ("message", "pages_short", "label", "request_id")),
        (S.RequestOffloading, ("message", "label", "request_id")),
        (S.AdmitRuntimeError, ("message",)),
        (S.ResourceStep, ("segments",)),
        (S.BucketKey, ("graph_walk", "bs", "num_tokens", "cg_key_info")),
        (S.SlotLease, ("slot", "bucket")),
        (
            S.StepContext,
            (
                "request_ids",
                "graph_walk",
                "slot",
                "capture",
                "is_preplan",
                "plan_results",
                "slot_lease",
                "piecewise_leases",
                "_padded_request_ids",
            ),
        ),
        (S.SubmoduleStep, ("steps", "segments", "cg_key_info", "_ctx")),
    ],
)
def test_dataclasses_with_seed_field_order(cls: type, fields: tuple) -> None:
    assert dataclasses.is_dataclass(cls)
    assert tuple(f.name for f in dataclasses.fields(cls)) == fields


def test_reason_hierarchy() -> None:
    for cls in (S.AllocationFailed, S.RequestOffloading, S.AdmitRuntimeError):
        assert issubclass(cls, S.AdmitFailedReason)
    failed = S.AllocationFailed("short", pages_short=3, label="main", request_id="r1")
    assert (failed.message, failed.pages_short, failed.label, failed.request_id) == (
        "short",
        3,
        "main",
        "r1",
    )
    assert S.AdmitRuntimeError("nope").message == "nope"


def test_defaults() -> None:
    assert S.ResourceStep().segments is None
    assert S.BucketKey("decode", 8, 8).cg_key_info is None
    ctx = S.StepContext(["a"], "decode", 0, False)
    assert ctx.is_preplan is False and ctx.plan_results == {} and ctx.slot_lease is None
    assert ctx.piecewise_leases == {}
    assert S.FullAdmitOutcome(S.ADMIT_OK).failed_resource is None


def test_singletons() -> None:
    assert S.AdmitOutcome(True, True, None) == S.ADMIT_OK
    assert S.FULL_ADMIT_OK.ok and S.FULL_ADMIT_OK.ready and S.FULL_ADMIT_OK.reason is None
    assert S.FULL_ADMIT_NOT_READY.ok and not S.FULL_ADMIT_NOT_READY.ready
    assert S.FULL_ADMIT_OK.outcome is S.ADMIT_OK


def test_full_outcome_properties_delegate() -> None:
    reason = S.RequestOffloading("moving", "main", "r")
    full = S.FullAdmitOutcome(S.AdmitOutcome(False, False, reason), "kv")
    assert (full.ok, full.ready, full.reason, full.failed_resource) == (False, False, reason, "kv")
    assert isinstance(type(full).ok, property)


def test_bucket_key_is_frozen_hashable_and_readable() -> None:
    key = S.BucketKey("decode", 4, 4, "fi")
    assert hash(key) == hash(S.BucketKey("decode", 4, 4, "fi"))
    assert str(key) == "decode[bs=4,tokens=4,key=fi]"
    with pytest.raises(dataclasses.FrozenInstanceError):
        key.bs = 5  # type: ignore[misc]


def test_padded_request_ids_falls_back_and_resets_on_new_rows() -> None:
    ctx = S.StepContext(["a", "b"], "decode", 0, False)
    assert list(ctx.padded_request_ids) == ["a", "b"]
    ctx.set_padded_rids(["a", "b", "pad0"])
    assert list(ctx.padded_request_ids) == ["a", "b", "pad0"]
    assert list(ctx.request_ids) == ["a", "b"]
    ctx.request_ids = ["a", "b"]  # identical rows keep the padding
    assert list(ctx.padded_request_ids) == ["a", "b", "pad0"]
    ctx.request_ids = ["a"]  # a dropped row invalidates it
    assert list(ctx.padded_request_ids) == ["a"]
    lease = S.SlotLease(1, None)
    ctx.set_piecewise_leases({"attn": lease})
    assert ctx.piecewise_leases == {"attn": lease}


def test_submodule_step_hands_default_segments_to_steps_without_their_own() -> None:
    own = (S.Segment("x", "main", 2),)
    plain, custom = S.ResourceStep(), S.ResourceStep(own)
    segs = [S.Segment("a", "main", 1), S.Segment("b", "main", 3)]
    step = S.SubmoduleStep({"kv": plain, "rope": custom}, segments=segs)
    assert plain.segments == tuple(segs)
    assert custom.segments is own
    assert "kv" in step and "attn" not in step
    assert step.get("kv") is plain and step.get("attn") is None
    assert list(step.keys()) == ["kv", "rope"]


def test_submodule_step_is_frozen_but_takes_its_context() -> None:
    step = S.SubmoduleStep({})
    assert step.ctx is None
    ctx = S.StepContext(["a"], "decode", 0, False)
    step.set_ctx(ctx)
    assert step.ctx is ctx
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.segments = []  # type: ignore[misc]


def test_segment_is_cheap_tuple() -> None:
    seg = S.Segment("r", "main", 0)
    assert seg == ("r", "main", 0) and seg.span == 0
    assert isinstance(seg, tuple)


def test_importing_step_imports_nothing_heavy() -> None:
    code = "import sys, mstar.engine.resources.step; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
