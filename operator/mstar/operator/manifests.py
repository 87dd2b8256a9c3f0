"""Desired child objects of one MStarDeployment, as plain dicts.

Pure functions of (name, namespace, uid, spec): the reconciler compares them with what is live
and patches the difference, so drift correction and rollouts are the same code path. A `None`
value means "this field must be absent": merge patches delete it, `strip_none` drops it on create.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict
from typing import Any, NamedTuple

from mstar.engine.config import to_cli_args

from .spec import (
    API_VERSION,
    ENGINE_PORT,
    KIND,
    MODEL_MOUNT,
    MStarSpec,
    engine_config,
)

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
RUN_AS_USER = 1000
#: After the preStop wait and the drain grace: aiohttp's cut-off, engine stop, process exit.
TERMINATION_MARGIN_SECONDS = 10


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
        },
    }


def config_hash(config_map: dict[str, Any]) -> str:
    text = json.dumps(config_map["data"], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _otel_env(name: str, namespace: str, spec: MStarSpec) -> list[dict[str, Any]]:
    telemetry = spec["telemetry"]
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "OTEL_SERVICE_NAME", "value": "mstar-engine"},
        {
            "name": "OTEL_RESOURCE_ATTRIBUTES",
            "value": (
                f"k8s.namespace.name={namespace},k8s.pod.name=$(POD_NAME),"
                f"mstar.deployment={name},gen_ai.request.model={spec.model['name']}"
            ),
        },
        {"name": "OTEL_METRICS_EXPORTER", "value": "none"},
        {"name": "OTEL_LOGS_EXPORTER", "value": "none"},
    ]
    if telemetry.get("otlpEndpoint"):
        env += [
            {"name": "OTEL_TRACES_EXPORTER", "value": "otlp"},
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": str(telemetry["otlpEndpoint"])},
            {"name": "OTEL_EXPORTER_OTLP_PROTOCOL", "value": "http/protobuf"},
            {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
            {"name": "OTEL_TRACES_SAMPLER_ARG", "value": str(float(telemetry["samplingRatio"]))},
        ]
    else:
        env.append({"name": "OTEL_TRACES_EXPORTER", "value": "none"})
    return env


def container_security() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def build_deployment(
    name: str, namespace: str, uid: str, spec: MStarSpec, config_map: dict[str, Any]
) -> dict[str, Any] | None:
    """The engine pods of a one-pod replica (several pods per replica: lws.py)."""
    if spec.nodes_per_replica > 1:
        return None
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "replicas": int(spec["replicas"]),
            "selector": {"matchLabels": selector_labels(name)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": 1800,
            # Never drop serving capacity during a rollout; a new pod must be Ready first.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": engine_pod_template(name, namespace, spec, config_map),
        },
    }


def engine_pod_template(
    name: str, namespace: str, spec: MStarSpec, config_map: dict[str, Any]
) -> dict[str, Any]:
    """An engine pod: GPU limits, flags from EngineConfig, probes, scrape annotations, OTEL env."""
    res = spec["resources"]
    gpus = int(res["gpus"])
    requests: dict[str, Any] = {"cpu": cpu_quantity(res["cpu"]), "memory": str(res["memory"])}
    limits: dict[str, Any] = {"memory": str(res["memory"])}
    if gpus > 0:
        requests[res["gpuResourceName"]] = str(gpus)
        limits[res["gpuResourceName"]] = str(gpus)
    source = spec.source
    cache_env: list[dict[str, Any]] = [
        {"name": "HOME", "value": "/tmp"},
        {"name": "XDG_CACHE_HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "engine-config", "mountPath": "/etc/mstar", "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(res["shmSize"])}},
        {"name": "engine-config", "configMap": {"name": config_map_name(name)}},
    ]
    init_containers: list[dict[str, Any]] | None = None
    if "pvc" in source:
        volumes.append(
            {
                "name": "models",
                "persistentVolumeClaim": {
                    "claimName": source["pvc"]["claimName"],
                    "readOnly": True,
                },
            }
        )
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
    elif "huggingFace" in source:
        hf = source["huggingFace"]
        volumes.append({"name": "models", "emptyDir": {"sizeLimit": str(hf["cacheSize"])}})
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        init_env: list[dict[str, Any]] = list(cache_env)
        if hf.get("tokenSecret"):
            secret = hf["tokenSecret"]
            init_env.append(
                {
                    "name": "HF_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
                }
            )
        init_containers = [
            {
                "name": "fetch-model",
                "image": spec["image"],
                "imagePullPolicy": spec["imagePullPolicy"],
                "command": ["hf", "download", str(hf["id"])],
                "args": ["--revision", str(hf["revision"]), "--local-dir", f"{MODEL_MOUNT}/hf"],
                "env": init_env,
                "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
                "securityContext": container_security(),
                "volumeMounts": [
                    {"name": "models", "mountPath": MODEL_MOUNT},
                    {"name": "cache", "mountPath": "/cache"},
                    {"name": "tmp", "mountPath": "/tmp"},
                ],
            }
        ]
    telemetry = spec["telemetry"]
    annotations: dict[str, Any] = {CONFIG_HASH_ANNOTATION: config_hash(config_map)}
    if telemetry["metrics"]:
        annotations.update(
            {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
            }
        )
    scheduling = spec["scheduling"]
    drain = spec["drain"]
    container = {
        "name": ENGINE_CONTAINER,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["mstar-engine", "serve"],
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        # The engine never downloads at run time (weights come from the image, a PVC or init).
        "env": [
            *_otel_env(name, namespace, spec),
            *cache_env,
            {"name": "HF_HUB_OFFLINE", "value": "1"},
        ],
        "resources": {"requests": requests, "limits": limits},
        "startupProbe": _probe("/health", 10, 90),
        # /health fails once the engine stops making progress (mstar.engine.server.liveness);
        # the engine then exits by itself, so this catches what cannot: an event loop that no
        # longer answers. Two misses 5 s apart (+ the 5 s timeout) restart it within 15 s.
        "livenessProbe": _probe("/health", 5, 2),
        "readinessProbe": _probe("/ready", 5, 3),
        # Kubernetes runs this before SIGTERM: serve until every router has let go of the pod.
        "lifecycle": {
            "preStop": {
                "exec": {
                    "command": [
                        "mstar-engine",
                        "prestop",
                        "--port",
                        str(ENGINE_PORT),
                        "--quiet-seconds",
                        str(float(drain["quietSeconds"])),
                        "--timeout-seconds",
                        str(float(drain["preStopTimeoutSeconds"])),
                    ]
                }
            }
        },
        "securityContext": container_security(),
        "volumeMounts": mounts,
    }
    return {
        "metadata": {"labels": pod_labels(name), "annotations": annotations},
        "spec": {
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "terminationGracePeriodSeconds": termination_grace_seconds(spec),
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": RUN_AS_USER,
                "runAsGroup": RUN_AS_USER,
                "fsGroup": RUN_AS_USER,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "initContainers": init_containers,
            "containers": [container],
            "volumes": volumes,
            "nodeSelector": scheduling.get("nodeSelector") or None,
            "tolerations": scheduling.get("tolerations") or None,
            "priorityClassName": scheduling.get("priorityClassName") or None,
        },
    }


def pod_labels(name: str) -> dict[str, str]:
    """Engine pods: the child labels plus the engine type the endpoint picker keys on."""
    return {**labels(name), ENGINE_TYPE_LABEL: ENGINE_TYPE}


def termination_grace_seconds(spec: MStarSpec) -> int:
    """preStop wait + drain grace + margin: the kubelet kills the pod only after all three."""
    return (
        int(spec["drain"]["preStopTimeoutSeconds"])
        + math.ceil(float(spec.engine["shutdownGraceSeconds"]))
        + TERMINATION_MARGIN_SECONDS
    )


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
