"""Desired child objects of one MStarDeployment, as plain dicts.

Pure functions of (name, namespace, uid, spec): the reconciler compares them with what is live
and patches the difference, so drift correction and rollouts are the same code path. A `None`
value means "this field must be absent": merge patches delete it, `strip_none` drops it on create.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from typing import Any, NamedTuple

from mstar.engine.config import to_cli_args

from .adapters import adapter_modules
from .spec import ADAPTERS_KEY, API_VERSION, KIND, MStarSpec, engine_config

MANAGED_BY = "mstar-operator"
INSTANCE_LABEL = "mstar.dev/deployment"
#: INSTANCE_LABEL as the chart's ServiceMonitor relabels it onto every engine series.
INSTANCE_METRIC_LABEL = "mstar_deployment"
#: The pod label the endpoint picker's metrics extractor reads to pick mstar's metric names.
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
ENGINE_TYPE = "mstar"
ENGINE_CONTAINER = "engine"
CONFIG_HASH_ANNOTATION = "mstar.dev/config-hash"
#: leader | worker on the pods of a LeaderWorkerSet group (spec.parallelism.nodesPerReplica > 1).
ROLE_LABEL = "mstar.dev/role"


def labels(name: str) -> dict[str, str]:
    """Labels on every child: selectors, `kubectl get -l`, the chart's ServiceMonitor."""
    return {
        "app.kubernetes.io/name": "mstar-engine",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        INSTANCE_LABEL: name,
    }


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment's (immutable) selector: only what can never change."""
    return {"app.kubernetes.io/name": "mstar-engine", INSTANCE_LABEL: name}


def serving_selector(name: str, spec: MStarSpec | None) -> dict[str, str]:
    """The pods that serve HTTP (Service, InferencePool, the HPA's per-pod metric): every engine
    pod, or only the group leaders where a replica spans several pods."""
    if spec is not None and spec.nodes_per_replica > 1:
        return {**selector_labels(name), ROLE_LABEL: "leader"}
    return selector_labels(name)


def selector_string(name: str, spec: MStarSpec | None = None) -> str:
    return ",".join(f"{k}={v}" for k, v in serving_selector(name, spec).items())


def owner_reference(name: str, uid: str) -> dict[str, Any]:
    """Makes the CR the controller of a child: Kubernetes garbage-collects it with the CR."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def child_metadata(name: str, namespace: str, owner: str, uid: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": namespace,
        "labels": labels(owner),
        "ownerReferences": [owner_reference(owner, uid)],
    }


def config_map_name(name: str) -> str:
    return f"{name}-engine"


def endpoint(name: str, namespace: str, spec: MStarSpec) -> str:
    return f"http://{name}.{namespace}.svc:{spec['service']['port']}"


def engine_args(spec: MStarSpec) -> list[str]:
    """The container args: `to_cli_args(EngineConfig)` with every setting explicit."""
    return to_cli_args(engine_config(spec), explicit=True)


def build_config_map(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any]:
    """The engine's settings in readable form, mounted at /etc/mstar (and hashed for rollouts)."""
    config = engine_config(spec)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": child_metadata(config_map_name(name), namespace, name, uid),
        "data": {
            "engine-config.json": json.dumps(asdict(config), indent=2, sort_keys=True),
            "engine-args.json": json.dumps(engine_args(spec)),
            ADAPTERS_KEY: json.dumps(adapter_modules(spec), indent=2),
        },
    }


def config_hash(config_map: dict[str, Any]) -> str:
    """What rolls the pods: every key but the adapter list, which the adapter sync hot-loads."""
    data = {k: v for k, v in config_map["data"].items() if k != ADAPTERS_KEY}
    text = json.dumps(data, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def build_pdb(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any] | None:
    """With several replicas, voluntary disruptions (node drains) take one replica at a time.

    A replica of several pods is one LeaderWorkerSet group: losing any of its pods restarts the
    whole group, so the budget is one group's pods (an eviction in a second group is refused
    while the first is down; more in the same group cost nothing)."""
    if int(spec["replicas"]) <= 1:
        return None
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "maxUnavailable": spec.nodes_per_replica,
            "selector": {"matchLabels": selector_labels(name)},
            # A pod that is not ready serves nothing: evicting it must never block a drain.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def build_service(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any]:
    service = spec["service"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "type": service["type"],
            "selector": serving_selector(name, spec),
            "ports": [
                {
                    "name": "http",
                    "port": int(service["port"]),
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def cpu_quantity(text: Any) -> str:
    """A CPU quantity as the API server stores it ("1.5" -> "1500m"), so it is no drift."""
    cpu = str(text)
    return cpu if cpu.endswith("m") else quantity(float(cpu))


def quantity(value: float) -> str:
    """A Kubernetes quantity for an HPA target: 4 -> "4", 0.5 -> "500m"."""
    if float(value).is_integer():
        return str(int(value))
    return f"{round(float(value) * 1000)}m"


class Child(NamedTuple):
    """One object the operator manages for a CR; `desired` None means "must not exist"."""

    kind: str
    name: str
    desired: dict[str, Any] | None


def strip_none(value: Any) -> Any:
    """Drop the `None` markers (for create, where absence is the default)."""
    if isinstance(value, dict):
        return {k: strip_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [strip_none(v) for v in value]
    return value


Path = tuple[str | int, ...]


def drift_paths(desired: Any, live: Any, path: Path = ()) -> list[tuple[Path, Any]]:
    """(path, desired value) wherever `live` differs from `desired`; None means "must be absent".

    Dicts compare by the desired keys only, lists item by item with the same length, so fields
    the server (defaults) or other controllers add never look like drift, while a hand edit of
    anything the operator sets does. The walk stops at the first differing node: its parent
    always exists in `live`, so each difference is one JSON-patch operation.
    """
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return [(path, desired)]
        out: list[tuple[Path, Any]] = []
        for key, want in desired.items():
            if want is None:
                if live.get(key) not in (None, {}, []):
                    out.append(((*path, key), None))
            else:
                out += drift_paths(want, live.get(key), (*path, key))
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [(path, desired)]
        out = []
        for i, (want, have) in enumerate(zip(desired, live, strict=True)):
            out += drift_paths(want, have, (*path, i))
        return out
    if isinstance(desired, str) and isinstance(live, (int, float)) and not isinstance(live, bool):
        return [] if desired == str(live) else [(path, desired)]
    return [] if desired == live else [(path, desired)]


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "/"


def drift(desired: Any, live: Any) -> list[str]:
    """The differing paths, dotted (for Events and logs)."""
    return [_dotted(path) for path, _ in drift_paths(desired, live)]


def json_patch(desired: Any, live: Any) -> list[dict[str, Any]]:
    """RFC 6902 operations that put back exactly the differing fields, nothing else.

    A JSON patch (not a strategic merge) so that lists are replaced, not merged: a hand-added
    env var or container arg is removed, and the next comparison finds no drift (no patch loop).
    """
    ops: list[dict[str, Any]] = []
    for path, want in drift_paths(desired, live):
        pointer = "/" + "/".join(str(p).replace("~", "~0").replace("/", "~1") for p in path)
        if want is None:
            ops.append({"op": "remove", "path": pointer})
        elif path and isinstance(path[-1], int):
            # "add" at a list index inserts (RFC 6902): the list would grow by one and the
            # next pass would replace it whole, a second rollout. The item exists: replace it.
            ops.append({"op": "replace", "path": pointer, "value": strip_none(want)})
        else:
            ops.append({"op": "add", "path": pointer, "value": strip_none(want)})
    return ops
