"""The per-step resource protocol: what a model declares, and what resources answer.

A submodule declares one `SubmoduleStep` per step; the `StepRunner` sweeps it through every
declared resource (admit -> plan -> commit). Admission is the only stage that may refuse, and it
refuses with values (`AdmitOutcome` carrying an `AdmitFailedReason`), never exceptions, so the
scheduler can answer each refusal by its type.

Hot values (`Segment`, `AdmitOutcome`, `FullAdmitOutcome`) are NamedTuples because one is built
per request per step; the common answers are module singletons so the hot path builds none.
"""

from __future__ import annotations

from collections.abc import KeysView, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "ADMIT_NOT_READY",
    "ADMIT_OK",
    "FULL_ADMIT_NOT_READY",
    "FULL_ADMIT_OK",
    "AdmitFailedReason",
    "AdmitOutcome",
    "AdmitRuntimeError",
    "AllocationFailed",
    "BucketKey",
    "FullAdmitOutcome",
    "RequestOffloading",
    "ResourceStep",
    "Segment",
    "SlotLease",
    "StepContext",
    "SubmoduleStep",
]


# ---------------------------------------------------------------------------------------------
# Admission outcomes
# ---------------------------------------------------------------------------------------------


@dataclass
class AdmitFailedReason:
    message: str


@dataclass
class AllocationFailed(AdmitFailedReason):
    pages_short: int
    label: str
    request_id: str


@dataclass
class RequestOffloading(AdmitFailedReason):
    """The request's state is moving to host memory; retry once it is back.

    Distinct from AllocationFailed because the answer is different: nothing needs evicting,
    the caller just re-drives the step once reload has run.
    """

    label: str
    request_id: str


@dataclass
class AdmitRuntimeError(AdmitFailedReason):
    """A resource cannot serve this request at all.

    Terminal, unlike the two above: no eviction and no reload makes it go away, so the caller's
    answer is to fail the request, not to retry it.
    """


class AdmitOutcome(NamedTuple):
    ok: bool
    ready: bool
    reason: AdmitFailedReason | None


class FullAdmitOutcome(NamedTuple):
    """What the runner answers with: one resource's outcome, plus which resource gave it.

    A resource doesn't know the key it is registered under, so the runner -- which does -- names
    it on the way out. The caller needs it to scope an eviction to the resource that actually
    ran out.
    """

    outcome: AdmitOutcome
    failed_resource: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome.ok

    @property
    def ready(self) -> bool:
        return self.outcome.ready

    @property
    def reason(self) -> AdmitFailedReason | None:
        return self.outcome.reason


# Shared answers: nothing reads their identity, so the hot path hands back these instances.
ADMIT_OK = AdmitOutcome(True, True, None)
ADMIT_NOT_READY = AdmitOutcome(True, False, None)
FULL_ADMIT_OK = FullAdmitOutcome(ADMIT_OK)
FULL_ADMIT_NOT_READY = FullAdmitOutcome(ADMIT_NOT_READY)


# ---------------------------------------------------------------------------------------------
# What a step declares
# ---------------------------------------------------------------------------------------------


class Segment(NamedTuple):
    """One step's addition to a request's cache stream.

    A request contributes one segment per label active for it in a step; the batch's ordered
    segment list defines the layout of per-token arrays. ``span`` may be 0: a zero-span segment
    reads its stream without extending it (admission reserves nothing, commit is a no-op).

    A NamedTuple, not a frozen dataclass: one is built per request per step, and the frozen
    dataclass's ``object.__setattr__``-per-field ``__init__`` is the expensive way to do that.
    """

    request_id: str
    label: str
    span: int


@dataclass
class ResourceStep:
    segments: tuple[Segment, ...] | None = None


@dataclass(frozen=True)
class BucketKey:
    graph_walk: str
    bs: int
    num_tokens: int
    cg_key_info: Any | None = None

    def __str__(self) -> str:
        return f"{self.graph_walk}[bs={self.bs},tokens={self.num_tokens},key={self.cg_key_info}]"


@dataclass(frozen=True)
class SlotLease:
    """Which double-buffer slot a step plans into and replays on; ``bucket`` None means eager.

    The model runner leases it when it builds the step's context; the resources read it from
    `StepContext.slot_lease` in plan (there is no separate release: the next step's lease
    takes the other slot).
    """

    slot: int
    bucket: BucketKey | None


@dataclass
class StepContext:
    request_ids: Sequence[str]
    graph_walk: str
    slot: int
    capture: bool
    is_preplan: bool = False
    plan_results: dict[str, Any] = field(default_factory=dict)
    slot_lease: SlotLease | None = None
    piecewise_leases: Mapping[str, SlotLease] = field(default_factory=dict)
    _padded_request_ids: Sequence[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # New real rows invalidate the padded layout, which would still name the old ones.
        if name == "request_ids" and self.__dict__.get("request_ids", value) != value:
            object.__setattr__(self, "_padded_request_ids", None)
        object.__setattr__(self, name, value)

    @property
    def padded_request_ids(self) -> Sequence[str]:
        padded = self._padded_request_ids
        return self.request_ids if padded is None else padded

    def set_padded_rids(self, padded_rids: Sequence[str] | None) -> None:
        self._padded_request_ids = padded_rids

    def set_piecewise_leases(self, leases: Mapping[str, SlotLease]) -> None:
        self.piecewise_leases = leases


@dataclass(frozen=True)
class SubmoduleStep:
    steps: dict[str, ResourceStep]
    segments: list[Segment] | None = None
    cg_key_info: Any | None = None
    _ctx: StepContext = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        # `segments` is the batch layout default; a step that brought its own keeps it.
        if self.segments is not None:
            default = tuple(self.segments)
            for step in self.steps.values():
                if step.segments is None:
                    step.segments = default

    @property
    def ctx(self) -> StepContext:
        return self._ctx

    def set_ctx(self, ctx: StepContext) -> None:
        object.__setattr__(self, "_ctx", ctx)

    def get(self, key: str) -> ResourceStep | None:
        return self.steps.get(key)

    def keys(self) -> KeysView[str]:
        return self.steps.keys()

    def __contains__(self, key: object) -> bool:
        return key in self.steps
