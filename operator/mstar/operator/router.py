"""Routing across replicas: the Gateway API Inference Extension children of an MStarDeployment.

With `spec.router` the operator creates an `InferencePool` (inference.networking.k8s.io/v1)
selecting the engine pods, its endpoint picker (EPP: ServiceAccount, RoleBinding to the chart's
ClusterRole, ConfigMap, Deployment, Service) configured to read mstar's metric names, and, with
`router.gateway`, an `HTTPRoute` sending that Gateway's traffic to the pool. The picker scores
every ready engine pod on queue depth, KV-cache usage and prefix-cache affinity, and, where the
engines serve LoRA adapters, on where the request's adapter is active.
"""

from __future__ import annotations

from typing import Any

import yaml

from .manifests import (
    CONFIG_HASH_ANNOTATION,
    ENGINE_TYPE,
    ENGINE_TYPE_LABEL,
    INSTANCE_LABEL,
    MANAGED_BY,
    Child,
    child_metadata,
    config_hash,
    container_security,
    cpu_quantity,
    owner_reference,
    serving_selector,
)
from .spec import ENGINE_PORT, MStarSpec

INFERENCE_GROUP = "inference.networking.k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"
EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_CONFIG_FILE = "epp-config.yaml"
DEFAULT_EPP_CLUSTER_ROLE = "mstar-epp"
#: An engine whose last good /metrics scrape is older than this is left out of the picker's
#: choice (while a fresher one exists): a dead engine's last metrics look idle, and the picker
#: scrapes every 50 ms (EPP's --refresh-metrics-interval), so 1 s is 20 missed scrapes.
METRICS_STALENESS_SECONDS = 1.0

#: What the picker reads from each engine pod's /metrics (the Model Server Protocol's metrics).
ENGINE_METRICS = {
    "queuedRequestsSpec": "mstar:num_requests_waiting",
    "runningRequestsSpec": "mstar:num_requests_running",
    "kvUsageSpec": "mstar:kv_cache_usage_perc",
    # vLLM's info-gauge shape: labels block_size (tokens per page) and num_gpu_blocks (pages).
    "cacheInfoSpec": "mstar:cache_config_info",
}
#: vLLM's LoRA info gauge under mstar's prefix: labels running_lora_adapters,
#: waiting_lora_adapters (comma-joined names), max_lora; the picker keeps the newest series.
#: Read only where the engines serve adapters: a spec naming a missing gauge makes the picker
#: log an extraction error on every scrape.
LORA_METRIC = "mstar:lora_requests_info"


def epp_name(name: str) -> str:
    return f"{name}-epp"


def epp_labels(name: str) -> dict[str, str]:
    """The picker's own labels: never matched by the engine selector or the ServiceMonitor."""
    return {
        "app.kubernetes.io/name": "mstar-epp",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "endpoint-picker",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        INSTANCE_LABEL: name,
    }


def _epp_metadata(name: str, namespace: str, uid: str) -> dict[str, Any]:
    return {
        "name": epp_name(name),
        "namespace": namespace,
        "labels": epp_labels(name),
        "ownerReferences": [owner_reference(name, uid)],
    }


def epp_config(spec: MStarSpec) -> dict[str, Any]:
    """The EndpointPickerConfig: mstar's metric names, a staleness filter, three scorers, and
    with adapters the LoRA affinity scorer (a request's `model` names its adapter: the picker
    takes it as the target model and prefers an engine listing it as running, then one with a
    free slot, then one where it waits)."""
    weights = spec["router"]["endpointPicker"]["weights"]
    lora_weight = int(weights["loraAffinity"])
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {
                "type": "metrics-data-source",
                "parameters": {"scheme": "http", "path": "/metrics", "insecureSkipVerify": True},
            },
            {
                "type": "core-metrics-extractor",
                "parameters": {
                    "engineLabelKey": ENGINE_TYPE_LABEL,
                    "defaultEngine": ENGINE_TYPE,
                    "engineConfigs": [
                        {
                            "name": ENGINE_TYPE,
                            **ENGINE_METRICS,
                            "loraSpec": LORA_METRIC if spec.serves_lora else "",
                        }
                    ],
                },
            },
            {
                # EPP v1.5.0's utilization detector is also a scheduling filter: it drops the
                # endpoints whose metrics are stale (and, past its thresholds, saturated ones;
                # it keeps them all when it would drop them all). Here it drops only the stale:
                # the thresholds are set out of reach, load is the scorers' business.
                "type": "utilization-detector",
                "name": "stale-metrics-filter",
                "parameters": {
                    "metricsStalenessThreshold": f"{METRICS_STALENESS_SECONDS}s",
                    "queueDepthThreshold": 2**31 - 1,
                    "kvCacheUtilThreshold": 1.0,
                    "headroom": 1.0,  # the KV limit 2.0: usage is a fraction, never above 1
                },
            },
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {
                "type": "prefix-cache-scorer",
                # mstar shares whole KV pages between requests with one prefix. With autoTune
                # the picker takes the page size and count from mstar:cache_config_info (its
                # per-engine prefix index then holds as many blocks as the engine has pages);
                # blockSizeTokens is the fallback until that is scraped.
                "parameters": {"autoTune": True, "blockSizeTokens": int(spec.engine["pageSize"])},
            },
            *([{"type": "lora-affinity-scorer"}] if spec.serves_lora else []),
            {"type": "max-score-picker"},
            {"type": "single-profile-handler"},
        ],
        # `dataLayer` in EPP v1.5.0 (its strict decoder refuses the older `data`).
        "dataLayer": {
            "sources": [
                {
                    "pluginRef": "metrics-data-source",
                    "extractors": [{"pluginRef": "core-metrics-extractor"}],
                }
            ]
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "stale-metrics-filter"},
                    {"pluginRef": "queue-scorer", "weight": int(weights["queue"])},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": int(weights["kvCache"])},
                    {"pluginRef": "prefix-cache-scorer", "weight": int(weights["prefixCache"])},
                    *(
                        [{"pluginRef": "lora-affinity-scorer", "weight": lora_weight}]
                        if spec.serves_lora
                        else []
                    ),
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


def build_inference_pool(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any]:
    picker = spec["router"]["endpointPicker"]
    return {
        "apiVersion": f"{INFERENCE_GROUP}/v1",
        "kind": "InferencePool",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "selector": {"matchLabels": serving_selector(name, spec)},
            "targetPorts": [{"number": ENGINE_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "group": "",
                "kind": "Service",
                "name": epp_name(name),
                "port": {"number": EPP_GRPC_PORT},
                "failureMode": str(picker["failureMode"]),
            },
        },
    }


def build_http_route(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any] | None:
    router = spec["router"]
    gateway = router.get("gateway")
    if not gateway:
        return None
    parent: dict[str, Any] = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": gateway["name"]}
    for key in ("namespace", "sectionName"):
        if gateway.get(key):
            parent[key] = gateway[key]
    return {
        "apiVersion": f"{GATEWAY_GROUP}/v1",
        "kind": "HTTPRoute",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": str(router["path"])}}],
                    "backendRefs": [
                        {"group": INFERENCE_GROUP, "kind": "InferencePool", "name": name}
                    ],
                    "timeouts": {"request": str(router["requestTimeout"])},
                }
            ],
        },
    }


def _epp_deployment(
    name: str, namespace: str, uid: str, spec: MStarSpec, config_map: dict[str, Any]
) -> dict[str, Any]:
    picker = spec["router"]["endpointPicker"]
    memory = str(picker["memory"])
    health = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}}
    container = {
        "name": "epp",
        "image": str(picker["image"]),
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--pool-name",
            name,
            "--pool-namespace",
            namespace,
            "--pool-group",
            INFERENCE_GROUP,
            "--config-file",
            f"/config/{EPP_CONFIG_FILE}",
            "--grpc-port",
            str(EPP_GRPC_PORT),
            "--grpc-health-port",
            str(EPP_HEALTH_PORT),
            "--metrics-port",
            str(EPP_METRICS_PORT),
            # Metrics auth would need cluster-wide TokenReview rights; the port stays in-cluster.
            "--metrics-endpoint-auth=false",
            "--zap-encoder",
            "json",
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_GRPC_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {**health, "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**health, "periodSeconds": 2},
        "resources": {
            "requests": {"cpu": cpu_quantity(picker["cpu"]), "memory": memory},
            "limits": {"memory": memory},
        },
        "securityContext": container_security(),
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _epp_metadata(name, namespace, uid),
        "spec": {
            "replicas": 1,  # one picker per pool: its prefix-cache index lives in memory
            "selector": {
                "matchLabels": {"app.kubernetes.io/name": "mstar-epp", INSTANCE_LABEL: name}
            },
            "strategy": {"type": "Recreate"},
            "template": {
                "metadata": {
                    "labels": epp_labels(name),
                    "annotations": {CONFIG_HASH_ANNOTATION: config_hash(config_map)},
                },
                "spec": {
                    "serviceAccountName": epp_name(name),
                    "enableServiceLinks": False,
                    "terminationGracePeriodSeconds": 30,
                    "securityContext": {
                        "runAsNonRoot": True,
                        "runAsUser": 65532,
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": epp_name(name)}}],
                },
            },
        },
    }


def build_router(
    name: str, namespace: str, uid: str, spec: MStarSpec, epp_cluster_role: str
) -> list[Child]:
    """Every routing child, in the order to apply them; all absent without `spec.router`."""
    epp = epp_name(name)
    if not spec.router:
        return [
            Child(kind, child, None)
            for kind, child in (
                ("HTTPRoute", name),
                ("InferencePool", name),
                ("Service", epp),
                ("Deployment", epp),
                ("ConfigMap", epp),
                ("RoleBinding", epp),
                ("ServiceAccount", epp),
            )
        ]
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _epp_metadata(name, namespace, uid),
        "data": {EPP_CONFIG_FILE: yaml.safe_dump(epp_config(spec), sort_keys=False)},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _epp_metadata(name, namespace, uid),
        "spec": {
            "type": "ClusterIP",
            "selector": {"app.kubernetes.io/name": "mstar-epp", INSTANCE_LABEL: name},
            "ports": [
                {  # ext-proc is gRPC over TLS: the picker's self-signed certificate by
                    # default (--secure-serving), which gateways accept unverified; no
                    # `kubernetes.io/h2c` here, or a gateway would speak cleartext to it.
                    "name": "grpc-ext-proc",
                    "port": EPP_GRPC_PORT,
                    "targetPort": "grpc",
                    "protocol": "TCP",
                },
                {
                    "name": "metrics",
                    "port": EPP_METRICS_PORT,
                    "targetPort": "metrics",
                    "protocol": "TCP",
                },
            ],
        },
    }
    return [
        Child(
            "ServiceAccount",
            epp,
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": _epp_metadata(name, namespace, uid),
            },
        ),
        Child(
            "RoleBinding",
            epp,
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding",
                "metadata": _epp_metadata(name, namespace, uid),
                # Watching pods and pools is granted in this namespace only.
                "roleRef": {
                    "apiGroup": "rbac.authorization.k8s.io",
                    "kind": "ClusterRole",
                    "name": epp_cluster_role,
                },
                "subjects": [{"kind": "ServiceAccount", "name": epp, "namespace": namespace}],
            },
        ),
        Child("ConfigMap", epp, config_map),
        Child("Deployment", epp, _epp_deployment(name, namespace, uid, spec, config_map)),
        Child("Service", epp, service),
        Child("InferencePool", name, build_inference_pool(name, namespace, uid, spec)),
        Child("HTTPRoute", name, build_http_route(name, namespace, uid, spec)),
    ]
