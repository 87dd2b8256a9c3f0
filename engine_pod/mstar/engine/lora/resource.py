"""`LoraResource`: adapter slots in the step protocol, admitted like KV pages.

A row whose request names an adapter is admitted once the adapter is resident; admission pins
it (`LoraPool.pin`) until the request is removed, so a running request's adapter is never
evicted. Otherwise admission refuses the row with a typed reason, by value:

- `AdapterLoading`: its adapter is being loaded (this admit may have started the load, evicting
  the least recently used idle adapter); the scheduler parks the row and retries it after
  ``retry_after``, and the other rows run meanwhile;
- `AdapterSlotsBusy`: every slot holds an adapter that admitted requests use; retried the same
  way, once one of them finishes;
- `RequestRejected` (terminal): the adapter was unregistered, or its folder failed to load.

`plan` hands the model runner each segment's slot (-1: the base model).
"""

from __future__ import annotations

from dataclasses import dataclass

from mstar.engine.lora.pool import LoraPool
from mstar.engine.resources.base import Resource
from mstar.engine.resources.refusals import RequestRejected
from mstar.engine.resources.step import (
    ADMIT_OK,
    AdmitFailedReason,
    AdmitOutcome,
    ResourceStep,
    StepContext,
)

#: How long a parked row waits before its admission is retried (the scheduler's hold).
RETRY_SECONDS = 0.005


@dataclass
class AdapterLoading(AdmitFailedReason):
    """The row's adapter is not resident yet: its load is in flight; retry after it lands."""

    adapter: str
    request_id: str
    retry_after: float = RETRY_SECONDS


@dataclass
class AdapterSlotsBusy(AdmitFailedReason):
    """Every adapter slot is held by running requests: retry once one finishes."""

    adapter: str
    request_id: str
    retry_after: float = RETRY_SECONDS


@dataclass(frozen=True)
class LoraPlan:
    """A step's segments' token counts and adapter slots (-1: the base model)."""

    lengths: tuple[int, ...]
    slots: tuple[int, ...]


class LoraResource(Resource):
    """Per-request adapter names (from the request's overrides) over a `LoraPool`."""

    def __init__(self, pool: LoraPool) -> None:
        self.pool = pool
        #: request id -> adapter name, for every ingested request that names one
        self.adapter_of: dict[str, str] = {}
        #: requests admitted (holding a pin on their adapter)
        self.pinned: set[str] = set()

    def ingest_request(self, request_id: str, overrides: object | None = None) -> None:
        if isinstance(overrides, str):
            self.adapter_of[request_id] = overrides
            self.pool.counters.requests[overrides] += 1

    def remove_request(self, request_id: str) -> None:
        name = self.adapter_of.pop(request_id, None)
        if name is not None and request_id in self.pinned:
            self.pinned.discard(request_id)
            self.pool.unpin(name)

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        pool = self.pool
        for seg in step.segments or ():
            rid = seg.request_id
            name = self.adapter_of.get(rid)
            if name is None or rid in self.pinned:
                continue
            if pool.try_pin(name):
                self.pinned.add(rid)
                continue
            reason = self._refusal(name, rid, pool.status(name))
            pool.counters.refusals[type(reason).__name__] += 1
            return AdmitOutcome(False, True, reason)
        return ADMIT_OK

    def _refusal(self, name: str, rid: str, status: str) -> AdmitFailedReason:
        pool = self.pool
        if not pool.known(name):
            return RequestRejected(f"the LoRA adapter {name!r} was unloaded", rid)
        if status == "failed":
            why = pool.failed.get(name, "")
            return RequestRejected(f"the LoRA adapter {name!r} failed to load: {why}", rid)
        if status == "loading" or pool.start_load(name):
            return AdapterLoading(f"LoRA adapter {name!r} is loading", name, rid)
        return AdapterSlotsBusy(f"all {pool.num_slots} LoRA slots hold adapters in use", name, rid)

    def plan(self, step: ResourceStep, ctx: StepContext) -> LoraPlan:
        lengths: list[int] = []
        slots: list[int] = []
        for seg in step.segments or ():
            name = self.adapter_of.get(seg.request_id)
            lengths.append(seg.span)
            slots.append(-1 if name is None else self.pool.slot(name))
        return LoraPlan(tuple(lengths), tuple(slots))

    def running_and_waiting(self) -> tuple[list[str], list[str]]:
        """vLLM's ``running_lora_adapters`` / ``waiting_lora_adapters``: the adapters that hold
        a slot (resident, idle ones too, and any an admitted request still runs), and those of
        requests not admitted yet. Idle resident adapters count as running because the endpoint
        picker's LoRA affinity reads this label as "loaded and ready to serve" (the inference
        extension's model server protocol: ActiveAdapters), and a slot is what vLLM's
        ``max_loras`` counts: an engine that holds an adapter but is idle still gets its
        requests."""
        served, resident, _ = self.pool.snapshot()
        running = dict.fromkeys(name for name in resident if name in served)
        waiting: dict[str, None] = {}
        for rid, name in list(self.adapter_of.items()):
            (running if rid in self.pinned else waiting)[name] = None
        return list(running), list(waiting)

    def cleanup(self) -> None:
        self.pool.close()
