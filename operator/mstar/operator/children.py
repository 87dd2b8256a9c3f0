"""All children of one MStarDeployment, in the order the reconciler applies them."""

from __future__ import annotations

from typing import Any

from .autoscaling import build_hpa, build_scaled_object
from .lws import build_leader_worker_set, lws_name
from .manifests import (
    Child,
    build_config_map,
    build_pdb,
    build_service,
    config_map_name,
)
from .pod import build_deployment
from .router import DEFAULT_EPP_CLUSTER_ROLE, build_router
from .spec import MStarSpec


def build_children(
    name: str,
    namespace: str,
    uid: str,
    spec: MStarSpec,
    epp_cluster_role: str = DEFAULT_EPP_CLUSTER_ROLE,
) -> list[Child]:
    """Every child (absent features as `desired` None, so a removed feature is deleted)."""
    config_map = build_config_map(name, namespace, uid, spec)
    deployment = Child("Deployment", name, build_deployment(name, namespace, uid, spec, config_map))
    group = Child(
        "LeaderWorkerSet",
        lws_name(name),
        build_leader_worker_set(name, namespace, uid, spec, config_map),
    )
    # The engine pods' owner: the one the spec asks for first, so that a change of layout
    # creates the new one before the old one is deleted.
    workloads = [deployment, group] if deployment.desired is not None else [group, deployment]
    return [
        Child("ConfigMap", config_map_name(name), config_map),
        Child("Service", name, build_service(name, namespace, uid, spec)),
        *workloads,
        Child("PodDisruptionBudget", name, build_pdb(name, namespace, uid, spec)),
        Child("HorizontalPodAutoscaler", name, build_hpa(name, namespace, uid, spec)),
        Child("ScaledObject", name, build_scaled_object(name, namespace, uid, spec)),
        *build_router(name, namespace, uid, spec, epp_cluster_role),
    ]


def child_of(children: list[Child], kind: str, name: str) -> dict[str, Any] | None:
    """The desired object of one child, by kind and name."""
    for child in children:
        if (child.kind, child.name) == (kind, name):
            return child.desired
    raise KeyError((kind, name))
