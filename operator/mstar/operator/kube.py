"""A small dict-in, dict-out facade over the official Kubernetes client.

The reconciler works on plain manifests (what `manifests` builds and `drift` compares), so this
module hides the typed models: every read is turned back into the JSON the API server sent.
"""

from __future__ import annotations

import base64
import datetime
import functools
import os
from collections.abc import Callable
from typing import Any

import kubernetes
from kubernetes.client.exceptions import ApiException

from .spec import GROUP, PLURAL, VERSION

REPORTER = "mstar-operator"
JSON_PATCH = "application/json-patch+json"

#: Kinds served by CRDs of other projects: kind -> (group, version, plural).
CUSTOM_KINDS = {
    "InferencePool": ("inference.networking.k8s.io", "v1", "inferencepools"),
    "HTTPRoute": ("gateway.networking.k8s.io", "v1", "httproutes"),
    "ScaledObject": ("keda.sh", "v1alpha1", "scaledobjects"),
    "LeaderWorkerSet": ("leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
}


class KubeError(Exception):
    """An API call that failed for a reason other than not-found / already-exists."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason


class MissingAPI(KubeError):
    """A kind whose CRDs this cluster lacks: not transient, so not worth a retry loop."""


def load_api_client(kubeconfig: str | None = None) -> kubernetes.client.ApiClient:
    """In-cluster credentials, else the kubeconfig named here or in $KUBECONFIG (read now).

    `kubernetes` reads $KUBECONFIG once at import; reading it here means a test (or a user) that
    sets it later still gets the cluster it asked for.
    """
    configuration = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        kubernetes.config.load_incluster_config(client_configuration=configuration)
    else:
        kubernetes.config.load_kube_config(
            config_file=path or os.path.expanduser("~/.kube/config"),
            client_configuration=configuration,
        )
    return kubernetes.client.ApiClient(configuration)


class Kube:
    """get / create / patch / delete for the kinds the operator owns, plus its own CR."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client
        core = self.core = kubernetes.client.CoreV1Api(api_client)
        apps = kubernetes.client.AppsV1Api(api_client)
        hpa = kubernetes.client.AutoscalingV2Api(api_client)
        policy = kubernetes.client.PolicyV1Api(api_client)
        rbac = kubernetes.client.RbacAuthorizationV1Api(api_client)
        self.custom = kubernetes.client.CustomObjectsApi(api_client)
        self._ops: dict[str, tuple[Callable[..., Any], ...]] = {
            kind: self._custom_ops(*where) for kind, where in CUSTOM_KINDS.items()
        }
        self._ops |= {
            "ConfigMap": (
                core.read_namespaced_config_map,
                core.create_namespaced_config_map,
                core.patch_namespaced_config_map,
                core.delete_namespaced_config_map,
            ),
            "Service": (
                core.read_namespaced_service,
                core.create_namespaced_service,
                core.patch_namespaced_service,
                core.delete_namespaced_service,
            ),
            "Deployment": (
                apps.read_namespaced_deployment,
                apps.create_namespaced_deployment,
                apps.patch_namespaced_deployment,
                apps.delete_namespaced_deployment,
            ),
            "HorizontalPodAutoscaler": (
                hpa.read_namespaced_horizontal_pod_autoscaler,
                hpa.create_namespaced_horizontal_pod_autoscaler,
                hpa.patch_namespaced_horizontal_pod_autoscaler,
                hpa.delete_namespaced_horizontal_pod_autoscaler,
            ),
            "PodDisruptionBudget": (
                policy.read_namespaced_pod_disruption_budget,
                policy.create_namespaced_pod_disruption_budget,
                policy.patch_namespaced_pod_disruption_budget,
                policy.delete_namespaced_pod_disruption_budget,
            ),
            "ServiceAccount": (
                core.read_namespaced_service_account,
                core.create_namespaced_service_account,
                core.patch_namespaced_service_account,
                core.delete_namespaced_service_account,
            ),
            "RoleBinding": (
                rbac.read_namespaced_role_binding,
                rbac.create_namespaced_role_binding,
                rbac.patch_namespaced_role_binding,
                rbac.delete_namespaced_role_binding,
            ),
        }

    def _custom_ops(self, group: str, version: str, plural: str) -> tuple[Callable[..., Any], ...]:
        """get/create/patch/delete of a CRD kind, with the typed APIs' argument order."""
        where = (group, version)
        custom = self.custom

        def read(name: str, namespace: str) -> Any:
            return custom.get_namespaced_custom_object(*where, namespace, plural, name)

        def create(namespace: str, body: dict[str, Any]) -> Any:
            return custom.create_namespaced_custom_object(*where, namespace, plural, body)

        def patch(name: str, namespace: str, body: Any) -> Any:
            return custom.patch_namespaced_custom_object(
                *where, namespace, plural, name, body, _content_type=JSON_PATCH
            )

        delete = functools.partial(custom.delete_namespaced_custom_object, *where)
        return read, create, patch, lambda name, ns: delete(ns, plural, name)

    def _dict(self, obj: Any) -> dict[str, Any]:
        if isinstance(obj, dict):
            return obj
        out = self.api_client.sanitize_for_serialization(obj)
        assert isinstance(out, dict)
        return out

    @staticmethod
    def _fail(exc: ApiException) -> KubeError:
        return KubeError(int(exc.status or 0), str(exc.reason), str(exc.body)[:500])

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._dict(self._ops[kind][0](name, namespace))
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._fail(exc) from exc

    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any] | None:
        """The created object, or None if one by that name already exists (409)."""
        try:
            return self._dict(self._ops[kind][1](namespace, body))
        except ApiException as exc:
            if exc.status == 409:
                return None
            if exc.status == 404 and kind in CUSTOM_KINDS:
                group, version, _ = CUSTOM_KINDS[kind]
                raise MissingAPI(
                    404,
                    "NotFound",
                    f"{kind}: this cluster does not serve {group}/{version} (install its CRDs)",
                ) from exc
            raise self._fail(exc) from exc

    def patch(
        self, kind: str, namespace: str, name: str, body: list[dict[str, Any]]
    ) -> dict[str, Any]:
        """Apply an RFC 6902 JSON patch."""
        try:
            return self._dict(self._ops[kind][2](name, namespace, body))
        except ApiException as exc:
            raise self._fail(exc) from exc

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        try:
            self._ops[kind][3](name, namespace)
            return True
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise self._fail(exc) from exc

    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        """The pods matching a label selector (the adapter sync's engine pods)."""
        try:
            listing = self.core.list_namespaced_pod(namespace, label_selector=selector)
        except ApiException as exc:
            raise self._fail(exc) from exc
        return [self._dict(pod) for pod in listing.items]

    def read_secret(self, namespace: str, name: str, key: str) -> str:
        """One key of a Secret, decoded (the engines' API key for the adapter sync); a
        `KubeError` names what is missing."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
        except ApiException as exc:
            raise self._fail(exc) from exc
        value = (secret.data or {}).get(key)
        if value is None:
            raise KubeError(404, "NotFound", f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(value).decode()

    def get_cr(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self._dict(
                self.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise self._fail(exc) from exc

    def post_event(self, obj: dict[str, Any], type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about `obj` (what `kubectl describe` shows); best effort."""
        meta = obj["metadata"]
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion", f"{GROUP}/{VERSION}"),
                "kind": obj.get("kind", "MStarDeployment"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": REPORTER},
            "reportingComponent": REPORTER,
            "reportingInstance": REPORTER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.core.create_namespaced_event(meta["namespace"], body)  # type: ignore[arg-type]
        except ApiException as exc:
            raise self._fail(exc) from exc

    def patch_cr_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(
                GROUP, VERSION, namespace, PLURAL, name, {"status": status}
            )
        except ApiException as exc:
            if exc.status == 404:
                return  # deleted meanwhile: nothing to report on
            raise self._fail(exc) from exc
