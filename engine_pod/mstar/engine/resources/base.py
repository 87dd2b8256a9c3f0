"""`Resource`: the fixed per-request and per-step lifecycle every engine resource follows.

Every method is a no-op default so a resource overrides only the stages it takes part in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mstar.engine.resources.step import ADMIT_OK, AdmitOutcome, ResourceStep, StepContext


class Resource:
    """Base class of a stateful per-node service (KV cache, attention, positions, sampler)."""

    #: Opt in to planning one step ahead (pre-admit / pre-plan) under a slot lease.
    supports_preplan: bool = False
    #: Can move a request's state to host memory and back.
    supports_eviction: bool = False

    # -- graph ---------------------------------------------------------------------------------
    def depends_on(self) -> set[str]:
        """Keys whose `plan` output this resource reads from `ctx.plan_results`."""
        return set()

    # -- per request ---------------------------------------------------------------------------
    def ingest_request(self, request_id: str, overrides: Any | None = None) -> None:
        """Open per-request state. Must be idempotent."""

    def remove_request(self, request_id: str) -> None:
        """Free everything the request holds, host copies included."""

    def reset_request(self, request_id: str, free: bool = False) -> None:
        """Return a padding row to rest; `free=True` also gives its storage back.

        ``free=True`` is also recompute: the request stays ingested (its overrides kept) and can
        run from its first token again, so every resource must accept a fresh prefill after it.
        """

    # -- per step ------------------------------------------------------------------------------
    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """Reserve capacity for the step. The only stage that may refuse (by value)."""
        return ADMIT_OK

    def plan(self, step: ResourceStep, ctx: StepContext) -> Any:
        """Build the step's addressing; the return lands in `ctx.plan_results[key]`."""
        return None

    def commit(self, step: ResourceStep, ctx: StepContext) -> None:
        """Record consumption after the forward; the only stage that advances lengths."""

    def abort_step(self, step: ResourceStep, ctx: StepContext) -> None:
        """Undo an admitted step whose forward failed: drop in-flight marks, advance nothing."""

    # -- pre-planning --------------------------------------------------------------------------
    def pre_admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        """Admit one step ahead; defaults to the ordinary admit."""
        return self.admit(step, ctx)

    def pre_plan(self, step: ResourceStep, ctx: StepContext) -> Any:
        """Plan one step ahead; defaults to the ordinary plan."""
        return self.plan(step, ctx)

    def clear_preplan(self) -> None:
        """Drop a staged pre-plan that the next step will not use."""

    # -- eviction ------------------------------------------------------------------------------
    def is_offloaded(self, request_id: str) -> bool:
        return False

    def offload(self, request_id: str) -> int:
        """Move the request's state to host memory; returns device pages freed (0: declined)."""
        return 0

    def reload(self, request_id: str) -> bool:
        """Bring an offloaded request back, all or nothing; False when the device is short."""
        return True

    def reclaimable(self, request_id: str) -> int:
        """Device pages an offload of this request would free."""
        return 0

    def get_offload_priority(self, request_id: str) -> float:
        """Higher means a better victim; asked only under the PRIORITY eviction policy."""
        return float(self.reclaimable(request_id))

    # -- engine --------------------------------------------------------------------------------
    def build_cuda_graph_buffers(self, slots: Sequence[Any], max_bs: int, max_seq_len: int) -> None:
        """Size static buffers for graph capture. Grow only: never clobber a captured address."""

    def cleanup(self) -> None:
        """Release everything at engine shutdown."""
