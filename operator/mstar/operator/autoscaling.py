"""Autoscaling children of an MStarDeployment: an HPA or a KEDA ScaledObject.

Both scale the MStarDeployment itself through its scale subresource, so `spec.replicas` stays
the one truth (replicas are LeaderWorkerSet groups where a replica spans several pods).
"""

from __future__ import annotations

from typing import Any

from .manifests import INSTANCE_METRIC_LABEL, child_metadata, quantity
from .spec import API_VERSION, KIND, MStarSpec


def build_hpa(name: str, namespace: str, uid: str, spec: MStarSpec) -> dict[str, Any] | None:
    """Scales the MStarDeployment itself (scale subresource), so spec.replicas stays the truth."""
    auto = spec.autoscaling
    if not auto or auto["mode"] != "hpa":
        return None
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicas": int(auto["minReplicas"]),
            "maxReplicas": int(auto["maxReplicas"]),
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": str(auto["metricName"])},
                        "target": {
                            "type": "AverageValue",
                            "averageValue": quantity(auto["targetWaitingRequestsPerReplica"]),
                        },
                    },
                }
            ],
        },
    }


def promql_selector(name: str, namespace: str) -> str:
    """The label matchers of this deployment's engine series in Prometheus."""
    return f'namespace="{namespace}",{INSTANCE_METRIC_LABEL}="{name}"'


def keda_queries(name: str, namespace: str) -> dict[str, str]:
    """The ScaledObject's PromQL: waiting requests, and running + waiting (busy) requests."""
    sel = promql_selector(name, namespace)
    waiting = f"sum(mstar:num_requests_waiting{{{sel}}})"
    return {"waiting": waiting, "busy": f"sum(mstar:num_requests_running{{{sel}}}) + {waiting}"}


def build_scaled_object(
    name: str, namespace: str, uid: str, spec: MStarSpec
) -> dict[str, Any] | None:
    """KEDA scales the MStarDeployment (0 <-> 1 itself, beyond that through its own HPA)."""
    auto = spec.autoscaling
    if not auto or auto["mode"] != "keda":
        return None
    keda = auto["keda"]
    queries = keda_queries(name, namespace)

    def trigger(kind: str, threshold: float) -> dict[str, Any]:
        return {
            "type": "prometheus",
            "name": kind,
            "metricType": "AverageValue",
            "metadata": {
                "serverAddress": str(keda["prometheusAddress"]),
                "query": queries[kind],
                "threshold": quantity(threshold),
                "activationThreshold": "0",
                "ignoreNullValues": "true",
            },
        }

    triggers = [
        trigger("waiting", float(auto["targetWaitingRequestsPerReplica"])),
        trigger("busy", float(spec.engine["maxNumSeqs"])),
        *(dict(t) for t in keda.get("extraTriggers") or []),
    ]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": child_metadata(name, namespace, name, uid),
        "spec": {
            "scaleTargetRef": {"apiVersion": API_VERSION, "kind": KIND, "name": name},
            "minReplicaCount": int(auto["minReplicas"]),
            "maxReplicaCount": int(auto["maxReplicas"]),
            "pollingInterval": int(keda["pollingIntervalSeconds"]),
            "cooldownPeriod": int(keda["cooldownSeconds"]),
            "triggers": triggers,
        },
    }
