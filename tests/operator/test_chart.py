"""The Helm chart: lints, renders objects passing `kubernetes-validate --strict`, least RBAC."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_render import CHART, granted_rules, render
from external_tools import require_tool

from mstar.operator import manifests


@pytest.fixture(autouse=True)
def _helm() -> None:
    require_tool("helm")


VARIANTS = {
    "defaults": (),
    "namespaced-with-monitoring": (
        "operator.watchNamespaces={team-a,team-b}",
        "serviceMonitor.enabled=true",
        "serviceMonitor.labels.release=kube-prometheus-stack",
        "operator.verbose=true",
    ),
    "no-dashboards-no-rbac": ("dashboards.enabled=false", "rbac.create=false"),
    "autoscaling-and-router": (
        "serviceMonitor.enabled=true",
        "router.enabled=true",
        "operator.watchNamespaces={models}",
    ),
    "no-router": ("router.enabled=false",),
}


def test_helm_lint() -> None:
    proc = subprocess.run(
        ["helm", "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
def test_rendered_manifests_validate_strictly(variant: str, tmp_path: Path) -> None:
    require_tool("kubernetes-validate")
    docs = render(*VARIANTS[variant])
    out = tmp_path / "rendered.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run(
        ["kubernetes-validate", "--strict", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout + proc.stderr
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment"} <= kinds


def test_operator_deployment() -> None:
    docs = render("operator.watchNamespaces={team-a}")
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert "--namespace=team-a" in container["args"]
    assert "--resync-seconds=300" in container["args"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True
    (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    (binding,) = [d for d in docs if d["kind"] == "RoleBinding"]
    assert binding["metadata"]["namespace"] == "team-a"
    assert not [d for d in docs if d["kind"] == "ClusterRoleBinding"]


MANAGED = ("get", "list", "watch", "create", "patch", "delete")


def test_rbac_is_least_privilege() -> None:
    """Exactly the calls the operator makes (the KMock tests check every call is covered)."""
    assert granted_rules() == {
        ("mstar.dev", "mstardeployments", "get"),
        ("mstar.dev", "mstardeployments", "list"),
        ("mstar.dev", "mstardeployments", "watch"),
        ("mstar.dev", "mstardeployments", "patch"),
        ("mstar.dev", "mstardeployments/status", "patch"),
        *(
            (group, resource, verb)
            for group, resource in (
                ("apps", "deployments"),
                ("", "services"),
                ("", "configmaps"),
                ("", "serviceaccounts"),
                ("autoscaling", "horizontalpodautoscalers"),
                ("policy", "poddisruptionbudgets"),
                ("rbac.authorization.k8s.io", "rolebindings"),
                ("inference.networking.k8s.io", "inferencepools"),
                ("gateway.networking.k8s.io", "httproutes"),
                ("keda.sh", "scaledobjects"),
                ("leaderworkerset.x-k8s.io", "leaderworkersets"),
            )
            for verb in MANAGED
        ),
        ("rbac.authorization.k8s.io", "clusterroles", "bind"),
        ("", "events", "create"),
        ("", "pods", "list"),  # the adapter sync's ready engine pods
        ("", "secrets", "get"),  # the engines' API key the adapter sync sends (apiKeySecret)
    }


def test_endpoint_picker_role_is_read_only_and_bindable_by_name() -> None:
    docs = render(include_crds=False)
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    epp = roles["mstar-epp"]
    assert {verb for rule in epp["rules"] for verb in rule["verbs"]} == {"get", "list", "watch"}
    assert {r for rule in epp["rules"] for r in rule["resources"]} >= {"pods", "inferencepools"}
    (bind,) = [r for r in roles["mstar-operator"]["rules"] if r["verbs"] == ["bind"]]
    assert bind["resourceNames"] == ["mstar-epp"]  # that one role, nothing else
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    (operator,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--epp-cluster-role=mstar-epp" in operator["args"]
    off = render("router.enabled=false", include_crds=False)
    assert [d["metadata"]["name"] for d in off if d["kind"] == "ClusterRole"] == ["mstar-operator"]


def test_service_monitor_selects_engine_services() -> None:
    docs = render("serviceMonitor.enabled=true")
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    wanted = monitor["spec"]["selector"]["matchLabels"]
    engine_labels = manifests.labels("any")
    assert wanted.items() <= engine_labels.items()
    assert monitor["spec"]["endpoints"][0]["port"] == "http"  # the engine Service's port name


def test_dashboards_are_sidecar_configmaps() -> None:
    docs = render()
    maps = [d for d in docs if d["kind"] == "ConfigMap"]
    assert maps, "no dashboard ConfigMaps rendered"
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(key for m in maps for key in m["data"]) == files
    for config_map in maps:
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        for text in config_map["data"].values():
            dashboard: dict[str, Any] = json.loads(text)
            assert dashboard["panels"]


def test_prometheus_adapter_values_hand_over_as_documented(tmp_path: Path) -> None:
    """The values.yaml command yields prometheus-adapter values carrying mstar's rule."""
    proc = subprocess.run(
        ["helm", "show", "values", str(CHART), "--jsonpath", "{.prometheusAdapter}"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    handed = json.loads(proc.stdout)
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert handed == values["prometheusAdapter"]
    assert handed["rules"]["default"] is False  # only mstar's metric, not the adapter's defaults
    (rule,) = handed["rules"]["custom"]
    assert rule["name"]["as"] == "mstar_num_requests_waiting"
