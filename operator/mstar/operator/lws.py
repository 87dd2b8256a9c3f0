"""A replica over several pods: the LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) of an
MStarDeployment with `spec.parallelism.nodesPerReplica` above 1.

One replica is one LWS group: a leader pod and `nodesPerReplica - 1` workers that the LWS
controller creates, restarts (any pod's restart recreates the whole group) and rolls out
together. Every pod runs `mstar-engine serve` with the same flags, plus its rank from the
environment the LWS pod webhook injects (`--node-rank $(LWS_WORKER_INDEX)`; the rendezvous is
`$(LWS_LEADER_ADDRESS):29500`, see `spec.engine_config`). The leader serves HTTP: probes, the
preStop drain, Prometheus scrape annotations, and the `leader` role that the Service, the
InferencePool and the HPA's selector pick. The workers have none of those; they join the
leader's process group.

The LWS is named `<name>-lws`: its controller makes a headless Service of the LWS's name for the
pods' DNS names and leaves an existing Service of that name alone, and `<name>` is the
engine's own Service.
"""

from __future__ import annotations

import copy
from typing import Any

from .manifests import CONFIG_HASH_ANNOTATION, ROLE_LABEL, child_metadata, labels
from .pod import engine_pod_template
from .spec import LWS_WORKER_INDEX, MStarSpec

LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API_VERSION = f"{LWS_GROUP}/v1"
#: Container fields only the HTTP-serving leader has (None: must be absent on a worker).
LEADER_ONLY = ("ports", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle")


def lws_name(name: str) -> str:
    return f"{name}-lws"


def _rank_args(template: dict[str, Any]) -> None:
    (container,) = template["spec"]["containers"]
    container["args"] = [*container["args"], "--node-rank", f"$({LWS_WORKER_INDEX})"]


def build_leader_worker_set(
    name: str, namespace: str, uid: str, spec: MStarSpec, config_map: dict[str, Any]
) -> dict[str, Any] | None:
    """The LWS of a multi-pod replica; None (must not exist) with one pod per replica."""
    nodes = spec.nodes_per_replica
    if nodes <= 1:
        return None
    leader = engine_pod_template(name, namespace, spec, config_map)
    _rank_args(leader)
    worker = copy.deepcopy(leader)
    leader["metadata"]["labels"][ROLE_LABEL] = "leader"
    worker["metadata"] = {
        "labels": {**labels(name), ROLE_LABEL: "worker"},
        "annotations": {
            CONFIG_HASH_ANNOTATION: leader["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
        },
    }
    (container,) = worker["spec"]["containers"]
    container.update(dict.fromkeys(LEADER_ONLY))
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": child_metadata(lws_name(name), namespace, name, uid),
        "spec": {
            "replicas": int(spec["replicas"]),
            # Workers start with the leader: it cannot be Ready before they have joined.
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
            # Like the Deployment: a new group is Ready before an old one goes.
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1, "partition": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
        },
    }
