"""One reconcile pass: bring the children of an MStarDeployment to the spec, then report status.

Idempotent and level-based: it reads what is live, patches only what drifted, creates what is
missing (a 409 means someone, e.g. a previous operator process, already made it), and so can be
run as often as events arrive: on CR changes, on every child change, after a restart. It never
raises for a bad spec; that becomes `Degraded=True, reason=InvalidSpec` and a Warning Event.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass, field
from typing import Any

from . import manifests
from .children import build_children
from .kube import Kube, KubeError, MissingAPI
from .lws import lws_name
from .router import DEFAULT_EPP_CLUSTER_ROLE
from .spec import KIND, InvalidSpec, MStarSpec, parse_spec

CONDITION_TYPES = ("Ready", "Progressing", "Degraded")

Event = tuple[str, str, str]  # (type: Normal|Warning, reason, message)

_locks: dict[tuple[str, str], threading.Lock] = {}
_locks_guard = threading.Lock()


def _lock_for(namespace: str, name: str) -> threading.Lock:
    """One reconcile at a time per CR: child events arrive in bursts from several watchers."""
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


@dataclass
class Outcome:
    events: list[Event] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    failed: bool = False  # a transient API failure: the caller should retry


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def controller_of(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The MStarDeployment owner reference of a child, if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and str(ref.get("apiVersion", "")).startswith("mstar.dev/"):
            return dict(ref)
    return None


def _condition(
    old: dict[Any, dict[str, Any]],
    kind: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    previous = old.get(kind)
    since = (
        previous.get("lastTransitionTime")
        if previous and previous.get("status") == status and previous.get("lastTransitionTime")
        else _now()
    )
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def compute_status(
    cr: dict[str, Any],
    deployment: dict[str, Any] | None,
    *,
    spec: MStarSpec | None,
    problems: list[str] | None = None,
    failure: str | None = None,
    failure_reason: str = "ReconcileFailed",
) -> dict[str, Any]:
    """The CR's status from the live workload (its Deployment, or its LeaderWorkerSet, whose
    status counts groups under the same field names) and what went wrong in this pass."""
    meta = cr["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    generation = int(meta.get("generation") or 1)
    old_status = cr.get("status") or {}
    old = {c.get("type"): c for c in old_status.get("conditions") or [] if isinstance(c, dict)}
    dep_status = (deployment or {}).get("status") or {}
    dep_spec = (deployment or {}).get("spec") or {}
    # With an invalid spec the last good Deployment keeps serving: report on it.
    desired = int(spec["replicas"] if spec is not None else dep_spec.get("replicas") or 0)
    replicas = int(dep_status.get("replicas") or 0)
    ready = int(dep_status.get("readyReplicas") or 0)
    updated = int(dep_status.get("updatedReplicas") or 0)
    dep_generation = int(((deployment or {}).get("metadata") or {}).get("generation") or 0)
    observed = int(dep_status.get("observedGeneration") or 0)
    rolled = deployment is not None and observed >= dep_generation and dep_generation > 0

    if deployment is None:
        multi = spec is not None and spec.nodes_per_replica > 1
        kind = "LeaderWorkerSet" if multi else "Deployment"
        ready_c = (False, f"{kind}Missing", f"the engine {kind} does not exist yet")
    elif desired == 0:
        ready_c = (False, "ScaledToZero", "spec.replicas is 0")
    elif ready >= desired and updated >= desired and rolled:
        ready_c = (True, "AllReplicasReady", f"{ready}/{desired} engine replicas ready")
    else:
        ready_c = (False, "ReplicasNotReady", f"{ready}/{desired} engine replicas ready")

    complete = rolled and updated >= desired and ready >= desired and replicas <= desired
    if complete:
        progressing_c = (False, "RolloutComplete", f"{updated} replicas on the current spec")
    else:
        progressing_c = (
            True,
            "RollingOut",
            f"{updated}/{desired} replicas updated, {ready} ready, {replicas} total",
        )

    dep_conditions = {c.get("type"): c for c in dep_status.get("conditions") or []}
    stalled = dep_conditions.get("Progressing", {})
    replica_failure = dep_conditions.get("ReplicaFailure", {})
    if problems:
        degraded_c = (True, "InvalidSpec", "; ".join(problems))
    elif failure:
        degraded_c = (True, failure_reason, failure)
    elif stalled.get("status") == "False" and stalled.get("reason") == "ProgressDeadlineExceeded":
        degraded_c = (True, "ProgressDeadlineExceeded", str(stalled.get("message", "")))
    elif replica_failure.get("status") == "True":
        degraded_c = (True, "ReplicaFailure", str(replica_failure.get("message", "")))
    else:
        degraded_c = (False, "AsExpected", "the children match the spec")

    port = spec["service"]["port"] if spec is not None else None
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "selector": manifests.selector_string(name, spec)
        if spec is not None
        else old_status.get("selector") or manifests.selector_string(name),
        "endpoint": f"http://{name}.{namespace}.svc:{port}"
        if port
        else old_status.get("endpoint", ""),
        "conditions": [
            _condition(old, kind, *values, generation)
            for kind, values in zip(
                CONDITION_TYPES, (ready_c, progressing_c, degraded_c), strict=True
            )
        ],
    }
    return status


def _status_events(old_status: dict[str, Any], new_status: dict[str, Any]) -> list[Event]:
    """Events for condition transitions (and a changed Degraded message), not for every pass."""
    old = {c.get("type"): c for c in old_status.get("conditions") or [] if isinstance(c, dict)}
    events: list[Event] = []
    for cond in new_status["conditions"]:
        prev = old.get(cond["type"], {})
        changed = prev.get("status") != cond["status"] or prev.get("reason") != cond["reason"]
        if cond["type"] == "Degraded" and cond["status"] == "True":
            if changed or prev.get("message") != cond["message"]:
                events.append(("Warning", cond["reason"], cond["message"]))
        elif cond["type"] == "Ready" and cond["status"] == "True" and changed:
            events.append(("Normal", "Ready", cond["message"]))
        elif cond["type"] == "Degraded" and changed and prev.get("status") == "True":
            events.append(("Normal", "Recovered", "no longer degraded"))
    return events


def _same_status(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def strip(s: dict[str, Any]) -> dict[str, Any]:
        # Only what this pass writes: status.adapters belongs to the adapter sync.
        out = {k: v for k, v in s.items() if k in b}
        out["conditions"] = sorted(
            (
                {k: v for k, v in c.items() if k != "lastTransitionTime"}
                for c in s.get("conditions") or []
            ),
            key=lambda c: str(c.get("type")),
        )
        return out

    return strip(a) == strip(b)


def reconcile(
    kube: Kube, cr: dict[str, Any], epp_cluster_role: str = DEFAULT_EPP_CLUSTER_ROLE
) -> Outcome:
    """Make the children match the CR and write its status; see the module docstring.

    `epp_cluster_role` is the chart's ClusterRole that the endpoint picker is bound to.
    """
    meta = cr["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    with _lock_for(namespace, name):
        fresh = kube.get_cr(namespace, name)  # act on the latest state, not a stale event body
        if fresh is None or fresh["metadata"].get("uid") != meta.get("uid"):
            return Outcome()
        if fresh["metadata"].get("deletionTimestamp"):
            return Outcome()
        return _reconcile_locked(kube, fresh, epp_cluster_role)


def _reconcile_locked(kube: Kube, cr: dict[str, Any], epp_cluster_role: str) -> Outcome:
    meta = cr["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    old_status = cr.get("status") or {}
    out = Outcome()
    problems: list[str] | None = None
    failure: str | None = None
    reason = "ReconcileFailed"
    spec: MStarSpec | None = None
    try:
        spec = parse_spec(cr.get("spec"))
    except InvalidSpec as exc:
        problems = exc.problems
    deployment: dict[str, Any] | None = None
    try:
        if spec is not None:
            _publish_selector(kube, name, namespace, old_status, spec)
            rollout = int(meta.get("generation") or 1) != old_status.get("observedGeneration")
            conflicts: list[KubeError | OwnershipConflict] = []
            workload_failed = False
            for child in build_children(name, namespace, uid, spec, epp_cluster_role):
                workload = (child.kind, child.name) in _workloads(name)
                if workload and child.desired is None and workload_failed:
                    continue  # the new workload could not be made: the old one keeps serving
                try:
                    live = _apply_child(kube, child, name, uid, namespace, rollout, out)
                except (OwnershipConflict, MissingAPI) as exc:
                    # In status, not retried: a resync or the user's fix heals it. Keep going.
                    conflicts.append(exc)
                    live = None
                    workload_failed |= workload
                if workload and child.desired is not None:
                    deployment = live
            failure = "; ".join(str(c) for c in conflicts) or None
            if conflicts and all(isinstance(c, MissingAPI) for c in conflicts):
                reason = "MissingAPI"
        else:
            deployment = _own_workload(kube, namespace, name, uid)
    except KubeError as exc:
        failure = str(exc)
        out.failed = True
        try:
            deployment = _own_workload(kube, namespace, name, uid)
        except KubeError:
            deployment = None
    status = compute_status(
        cr, deployment, spec=spec, problems=problems, failure=failure, failure_reason=reason
    )
    out.events += _status_events(old_status, status)
    out.status = status
    if not _same_status(old_status, status):
        kube.patch_cr_status(namespace, name, status)
    return out


def _publish_selector(
    kube: Kube, name: str, namespace: str, old_status: dict[str, Any], spec: MStarSpec
) -> None:
    """Write status.selector before any child exists: the HPA reads it through the scale
    subresource and answers `SelectorRequired` while it is empty."""
    selector = manifests.selector_string(name, spec)
    if old_status.get("selector") != selector:
        kube.patch_cr_status(namespace, name, {"selector": selector})
        old_status["selector"] = selector


def _workloads(name: str) -> tuple[tuple[str, str], ...]:
    """(kind, name) of the children that own the engine pods: the Deployment of one-pod
    replicas, the LeaderWorkerSet of multi-pod ones (not the endpoint picker's Deployment)."""
    return (("Deployment", name), ("LeaderWorkerSet", lws_name(name)))


def _own_workload(kube: Kube, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
    """The live Deployment or LeaderWorkerSet this CR controls (with an invalid spec the last
    good one keeps serving)."""
    for kind, child in _workloads(name):
        live = kube.get(kind, namespace, child)
        owner = controller_of(live) if live else None
        if owner and owner.get("uid") == uid:
            return live
    return None


class OwnershipConflict(Exception):
    """A child's name is taken by an object this CR does not control; never steal it."""


def _apply_child(
    kube: Kube,
    spec_child: manifests.Child,
    name: str,
    uid: str,
    namespace: str,
    rollout: bool,
    out: Outcome,
) -> dict[str, Any] | None:
    kind, child, desired = spec_child
    live = kube.get(kind, namespace, child)
    if desired is None:
        owner = controller_of(live) if live else None
        if live is not None and owner and owner.get("uid") == uid:
            kube.delete(kind, namespace, child)
            out.events.append(("Normal", "Deleted", f"{kind} {child}: no longer in the spec"))
        return None
    if live is None:
        created = kube.create(kind, namespace, manifests.strip_none(desired))
        if created is not None:
            if rollout:
                out.events.append(("Normal", "Created", f"{kind} {child}"))
            else:
                out.events.append(
                    ("Normal", "DriftCorrected", f"{kind} {child} was deleted: recreated")
                )
            return created
        live = kube.get(kind, namespace, child)  # lost a race with another pass: patch it
        if live is None:
            raise KubeError(409, "Conflict", f"{kind} {child} exists but cannot be read")
    owner = controller_of(live)
    if owner is None or owner.get("name") != name:
        raise OwnershipConflict(
            f"{kind} {child} already exists and is not controlled by this MStarDeployment"
        )
    ops = manifests.json_patch(desired, live)
    if not ops:
        return live
    paths = manifests.drift(desired, live)
    patched = kube.patch(kind, namespace, child, ops)
    shown = ", ".join(paths[:4]) + (f" (+{len(paths) - 4} more)" if len(paths) > 4 else "")
    if rollout:
        out.events.append(("Normal", "Updated", f"{kind} {child}: {shown}"))
    else:
        out.events.append(("Normal", "DriftCorrected", f"{kind} {child} edited by hand: {shown}"))
    return patched
