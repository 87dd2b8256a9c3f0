"""The engine pod: its template (container, probes, volumes, environment) and its Deployment.

Split from `manifests` (the other children and the drift machinery): one engine pod serves a
one-pod replica from a Deployment, or one rank of a LeaderWorkerSet group (lws.py reuses the
template). Adapter volumes and downloads come from `adapters.py`.
"""

from __future__ import annotations

import math
from typing import Any

from mstar.engine.cli import API_KEY_ENV

from .adapters import ADAPTER_MOUNT, HF_ADAPTER_VOLUME, adapter_volumes, hf_adapters
from .manifests import (
    CONFIG_HASH_ANNOTATION,
    ENGINE_CONTAINER,
    ENGINE_TYPE,
    ENGINE_TYPE_LABEL,
    child_metadata,
    config_hash,
    config_map_name,
    container_security,
    cpu_quantity,
    engine_args,
    labels,
    selector_labels,
)
from .spec import CONFIG_MOUNT, ENGINE_PORT, MODEL_MOUNT, MStarSpec

RUN_AS_USER = 1000
#: After the preStop wait and the drain grace: aiohttp's cut-off, engine stop, process exit.
TERMINATION_MARGIN_SECONDS = 10
#: Where the engine and the download init containers keep caches (the root FS is read-only).
CACHE_ENV: list[dict[str, Any]] = [
    {"name": "HOME", "value": "/tmp"},
    {"name": "XDG_CACHE_HOME", "value": "/cache"},
    {"name": "HF_HOME", "value": "/cache/huggingface"},
]


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
    mounts: list[dict[str, Any]] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "engine-config", "mountPath": CONFIG_MOUNT, "readOnly": True},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "tmp", "emptyDir": {}},
        {"name": "cache", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": str(res["shmSize"])}},
        {"name": "engine-config", "configMap": {"name": config_map_name(name)}},
    ]
    init_containers: list[dict[str, Any]] = []
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
        init_containers.append(
            _fetch_container("fetch-model", spec, hf, f"{MODEL_MOUNT}/hf", "models", MODEL_MOUNT)
        )
    adapter_vols, adapter_mounts = adapter_volumes(spec)
    volumes += adapter_vols
    mounts += adapter_mounts
    for i, (hf, folder) in enumerate(hf_adapters(spec)):
        init_containers.append(
            _fetch_container(
                f"fetch-adapter-{i}", spec, hf, folder, HF_ADAPTER_VOLUME, f"{ADAPTER_MOUNT}/hf"
            )
        )
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
            *CACHE_ENV,
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            *_api_key_env(spec),
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
            "initContainers": init_containers or None,
            "containers": [container],
            "volumes": volumes,
            "nodeSelector": scheduling.get("nodeSelector") or None,
            "tolerations": scheduling.get("tolerations") or None,
            "priorityClassName": scheduling.get("priorityClassName") or None,
        },
    }


def _api_key_env(spec: MStarSpec) -> list[dict[str, Any]]:
    """The engine's API key from spec.apiKeySecret (`mstar-engine serve` reads it from the
    environment, so it is in no arg and no ConfigMap)."""
    secret = spec.api_key_secret
    if secret is None:
        return []
    ref = {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}}
    return [{"name": API_KEY_ENV, "valueFrom": ref}]


def _fetch_container(
    container: str, spec: MStarSpec, hf: dict[str, Any], folder: str, volume: str, mount: str
) -> dict[str, Any]:
    """An init container downloading a Hugging Face repository (the model or an adapter) into
    `folder` on the emptyDir `volume`: the engine container runs offline."""
    env: list[dict[str, Any]] = list(CACHE_ENV)
    if hf.get("tokenSecret"):
        secret = hf["tokenSecret"]
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": secret["name"], "key": secret["key"]}},
            }
        )
    return {
        "name": container,
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["hf", "download", str(hf["id"])],
        "args": ["--revision", str(hf["revision"]), "--local-dir", folder],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": container_security(),
        "volumeMounts": [
            {"name": volume, "mountPath": mount},
            {"name": "cache", "mountPath": "/cache"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
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
