"""`StepRunner`: drives one declared step through every resource in dependency order.

Everything structural is settled once at construction (topological order, pre-plan subset);
per step the runner only looks up a cached key order and loops. Admission short-circuits on the
first refusal and names the refusing resource, because a resource does not know the key it is
registered under. No resource here answers ``ok=True, ready=False`` (that is for state arriving
from another worker, which this engine does not have), so a sweep with no refusal is admitted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mstar.engine.resources.base import Resource
from mstar.engine.resources.step import FULL_ADMIT_OK, FullAdmitOutcome, SubmoduleStep

StageKey = tuple[Any, ...]


def topo_order(resources: Mapping[str, Resource]) -> tuple[str, ...]:
    """Kahn's algorithm over `depends_on`; each ready layer alphabetical, so order is stable."""
    deps: dict[str, set[str]] = {}
    for key, res in resources.items():
        wanted = set(res.depends_on())
        if key in wanted:
            raise ValueError(f"resource {key!r} depends on itself")
        unknown = sorted(wanted - resources.keys())
        if unknown:
            raise ValueError(f"resource {key!r} depends on unknown key(s): {', '.join(unknown)}")
        deps[key] = wanted
    order: list[str] = []
    ready = sorted(k for k, d in deps.items() if not d)
    remaining = {k: set(d) for k, d in deps.items() if d}
    while ready:
        order.extend(ready)
        done = set(ready)
        ready = []
        for key in sorted(remaining):
            remaining[key] -= done
            if not remaining[key]:
                ready.append(key)
        for key in ready:
            del remaining[key]
    if remaining:
        raise ValueError(f"dependency cycle among resources: {', '.join(sorted(remaining))}")
    return tuple(order)


class StepRunner:
    """Sequencer of the per-step protocol over a node's resources (see module docstring)."""

    def __init__(self, resources: Mapping[str, Resource]) -> None:
        self.resources: dict[str, Resource] = dict(resources)
        self.order = topo_order(self.resources)
        self._rank = {key: i for i, key in enumerate(self.order)}
        self.preplan_order = tuple(k for k in self.order if self.resources[k].supports_preplan)
        self._check_preplan_deps()
        self._key_cache: dict[frozenset[str], tuple[str, ...]] = {}
        self._preplan_key_cache: dict[frozenset[str], tuple[str, ...]] = {}
        self._staged: StageKey | None = None

    # -- construction helpers ------------------------------------------------------------------
    def _check_preplan_deps(self) -> None:
        preplanners = set(self.preplan_order)
        for key in self.preplan_order:
            lagging = sorted(self.resources[key].depends_on() - preplanners)
            if lagging:
                raise ValueError(
                    f"resource {key!r} pre-plans but depends on {', '.join(lagging)}, which do "
                    "not: it would read the in-flight step's plan output"
                )

    def _keys_for(self, step: SubmoduleStep) -> tuple[str, ...]:
        keyset = frozenset(step.steps)
        order = self._key_cache.get(keyset)
        if order is None:
            missing = sorted(keyset - self.resources.keys())
            if missing:
                raise KeyError(f"the node does not have resource(s) {', '.join(missing)}")
            order = tuple(sorted(keyset, key=self._rank.__getitem__))
            self._key_cache[keyset] = order
        return order

    def _preplan_keys_for(self, step: SubmoduleStep) -> tuple[str, ...]:
        keyset = frozenset(step.steps)
        order = self._preplan_key_cache.get(keyset)
        if order is None:
            preplanners = set(self.preplan_order)
            order = tuple(k for k in self._keys_for(step) if k in preplanners)
            self._preplan_key_cache[keyset] = order
        return order

    # -- per request ---------------------------------------------------------------------------
    def ingest_request(self, request_id: str, overrides: Mapping[str, Any] | None = None) -> None:
        for key in self.order:
            self.resources[key].ingest_request(
                request_id, None if overrides is None else overrides.get(key)
            )

    def remove_request(self, request_id: str) -> None:
        for key in self.order:
            self.resources[key].remove_request(request_id)

    def reset_request(self, request_id: str, free: bool = False) -> None:
        """Reset the request in every resource at once (recompute drops all of its state)."""
        for key in self.order:
            self.resources[key].reset_request(request_id, free)

    # -- per step ------------------------------------------------------------------------------
    def admit(self, step: SubmoduleStep) -> FullAdmitOutcome:
        """Sweep the declared resources; the first refusal wins and is named."""
        self._drop_stale_preplan(step)
        return self._sweep_admit(step, self._keys_for(step), preplan=False)

    def plan(self, step: SubmoduleStep) -> dict[str, Any]:
        """Plan in dependency order; `ctx.plan_results` is the only channel between resources."""
        if not step.ctx.is_preplan:
            self._drop_stale_preplan(step)
            self._staged = None
        return self._sweep_plan(step, self._keys_for(step), preplan=False)

    def commit(self, step: SubmoduleStep) -> None:
        ctx = step.ctx
        steps = step.steps
        resources = self.resources
        for key in self._keys_for(step):
            resources[key].commit(steps[key], ctx)

    def abort_step(self, step: SubmoduleStep) -> None:
        """Undo an admitted step on every declared resource, even past one that raises."""
        errors: list[BaseException] = []
        for key in self._keys_for(step):
            try:
                self.resources[key].abort_step(step.steps[key], step.ctx)
            except Exception as exc:  # keep going: every resource must drop its marks
                errors.append(exc)
        if errors:
            raise errors[0]

    # -- pre-planning one step ahead -----------------------------------------------------------
    def pre_admit(self, step: SubmoduleStep) -> FullAdmitOutcome:
        return self._sweep_admit(step, self._preplan_keys_for(step), preplan=True)

    def pre_plan(self, step: SubmoduleStep) -> dict[str, Any]:
        results = self._sweep_plan(step, self._preplan_keys_for(step), preplan=True)
        self._staged = self._stage_key(step)
        return results

    def clear_preplan(self) -> None:
        for key in self.order:
            self.resources[key].clear_preplan()
        self._staged = None

    @property
    def staged(self) -> StageKey | None:
        return self._staged

    def _stage_key(self, step: SubmoduleStep) -> StageKey:
        ctx = step.ctx
        lease = ctx.slot_lease
        return (
            ctx.graph_walk,
            tuple(ctx.padded_request_ids),
            None if lease is None else lease.slot,
            tuple((k, step.steps[k].segments) for k in self._preplan_keys_for(step)),
        )

    def _drop_stale_preplan(self, step: SubmoduleStep) -> None:
        # All or nothing: a stage for other rows must not be promoted by any resource.
        if self._staged is not None and self._staged != self._stage_key(step):
            self.clear_preplan()

    def _sweep_admit(
        self, step: SubmoduleStep, order: Sequence[str], preplan: bool
    ) -> FullAdmitOutcome:
        ctx = step.ctx
        steps = step.steps
        resources = self.resources
        for key in order:
            res = resources[key]
            outcome = res.pre_admit(steps[key], ctx) if preplan else res.admit(steps[key], ctx)
            if not outcome.ok:
                return FullAdmitOutcome(outcome, key)
        return FULL_ADMIT_OK

    def _sweep_plan(
        self, step: SubmoduleStep, order: Sequence[str], preplan: bool
    ) -> dict[str, Any]:
        ctx = step.ctx
        steps = step.steps
        resources = self.resources
        results = ctx.plan_results
        results.clear()
        for key in order:
            res = resources[key]
            results[key] = res.pre_plan(steps[key], ctx) if preplan else res.plan(steps[key], ctx)
        return results

    # -- eviction, scoped to the resources that ran out ----------------------------------------
    def _evictable(self, keys: Iterable[str] | None) -> list[Resource]:
        chosen = self.order if keys is None else [k for k in self.order if k in set(keys)]
        return [self.resources[k] for k in chosen if self.resources[k].supports_eviction]

    def reclaimable(self, request_id: str, keys: Iterable[str] | None = None) -> int:
        return sum(res.reclaimable(request_id) for res in self._evictable(keys))

    def offload_priority(self, request_id: str, keys: Iterable[str] | None = None) -> float:
        return sum(res.get_offload_priority(request_id) for res in self._evictable(keys))

    def offload(self, request_id: str, keys: Iterable[str] | None = None) -> int:
        """Offload the request from every evictable resource; returns device pages freed."""
        return sum(res.offload(request_id) for res in self._evictable(keys))

    def reload(self, request_id: str) -> bool:
        """Reload the request everywhere it is offloaded; False when any resource is short."""
        return all(
            res.reload(request_id) for res in self._evictable(None) if res.is_offloaded(request_id)
        )

    def is_offloaded(self, request_id: str) -> bool:
        return any(res.is_offloaded(request_id) for res in self._evictable(None))

    # -- engine --------------------------------------------------------------------------------
    def build_cuda_graph_buffers(self, slots: Sequence[Any], max_bs: int, max_seq_len: int) -> None:
        for key in self.order:
            self.resources[key].build_cuda_graph_buffers(slots, max_bs, max_seq_len)
