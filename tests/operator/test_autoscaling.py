"""Autoscaling end to end. The prometheus-adapter rule shipped in the chart's values and the KEDA
ScaledObject's queries, evaluated by a real Prometheus scraping the real engine server under
load, return the waiting count the server reports. The scale subresource and the HPA on a real
control plane: tests/operator/test_cluster.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit
from extension_schemas import install, load, problems
from external_tools import require_tool
from kube_emulator import EmulatedCluster
from live_server import BackgroundLoad, LiveServer, make_engine
from op_harness import CRS, ROOT, Kubectl, Operator, wait_for

from mstar.operator import manifests
from mstar.operator.children import build_children, child_of
from mstar.operator.spec import AUTOSCALING_DEFAULTS, parse_spec
from tests.prometheus_helper import query, run_prometheus

VALUES = ROOT / "charts" / "mstar" / "values.yaml"
NS, NAME = "team-a", "smollm2"
PODS = ["smollm2-5d8f7c9b4-x2x7q"]
# What the chart's ServiceMonitor gives every engine series in a cluster.
SCRAPE_LABELS = {"namespace": NS, "pod": PODS[0], manifests.INSTANCE_METRIC_LABEL: NAME}
RUNNING, IN_FLIGHT = 2, 6  # max_num_seqs, and requests kept in flight: 4 always wait


def adapter_rules() -> list[dict[str, Any]]:
    values = yaml.safe_load(VALUES.read_text())
    rules = values["prometheusAdapter"]["rules"]["custom"]
    assert isinstance(rules, list)
    return rules


def adapter_query(rule: dict[str, Any], namespace: str, pods: list[str]) -> str:
    """The PromQL prometheus-adapter runs for GET .../namespaces/NS/pods/*/METRIC."""
    match = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
    assert match, rule["seriesQuery"]
    fields = {
        "Series": match.group(0),
        "LabelMatchers": f'namespace="{namespace}",pod=~"{"|".join(pods)}"',
        "GroupBy": "pod",
    }
    promql = str(rule["metricsQuery"])
    for key, value in fields.items():
        promql = promql.replace(f"<<.{key}>>", value)
    assert "<<" not in promql, f"a template field the test does not know: {promql}"
    return promql


#: Long completions kept in flight: each one done is replaced at once.
STEADY_BODY = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True}


@pytest.fixture()
def loaded(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    with (
        LiveServer(make_engine(tiny_llama_dir, max_num_seqs=RUNNING)) as live,
        BackgroundLoad(live.url, IN_FLIGHT, lambda _: STEADY_BODY),
    ):
        yield live


def _until_equal(prom: str, promql: str, server: Any, what: str) -> float:
    """Poll until the PromQL value equals what the server reports now (and it is > 0)."""
    last: tuple[Any, float] = ((), 0.0)

    def same() -> float | None:
        nonlocal last
        rows = query(prom, promql)
        reported = server()
        last = (rows, reported)
        if len(rows) == 1 and reported > 0 and float(rows[0]["value"][1]) == reported:
            return reported
        return None

    try:
        return wait_for(same, what, timeout=60)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last rows/server value: {last}") from None


def test_adapter_rule_and_keda_queries_return_the_servers_waiting_count(
    loaded: LiveServer,
) -> None:
    require_tool("prometheus")
    (rule,) = adapter_rules()
    # The HPA asks for the name the rule exposes.
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"])
    assert series and re.fullmatch(rule["name"]["matches"], series.group(0))
    assert rule["name"]["as"] == AUTOSCALING_DEFAULTS["metricName"]
    doc, _ = admit(yaml.safe_load((ROOT / "examples" / "mstardeployment.yaml").read_text()))
    hpa = child_of(
        build_children(NAME, NS, "u", parse_spec(doc["spec"])), "HorizontalPodAutoscaler", NAME
    )
    assert hpa is not None
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == rule["name"]["as"]

    keda, _ = admit(yaml.safe_load((CRS / "valid-keda.yaml").read_text()))
    scaled = child_of(build_children(NAME, NS, "u", parse_spec(keda["spec"])), "ScaledObject", NAME)
    assert scaled is not None
    assert problems("scaledobject", scaled) == []
    waiting, busy = scaled["spec"]["triggers"][:2]
    allowed = set(load("scaledobject")["prometheusMetadata"])
    assert set(waiting["metadata"]) <= allowed and set(busy["metadata"]) <= allowed

    def server_waiting() -> float:
        return loaded.metric("mstar:num_requests_waiting")

    def server_busy() -> float:
        return server_waiting() + loaded.metric("mstar:num_requests_running")

    with run_prometheus([f"127.0.0.1:{loaded.port}"], labels=SCRAPE_LABELS) as prom:
        # Discovery: the rule's series query finds the series, with the labels it maps to pods.
        wait_for(lambda: query(prom, rule["seriesQuery"]), "the adapter's series query")
        (row,) = query(prom, rule["seriesQuery"])
        for label, target in rule["resources"]["overrides"].items():
            assert label in row["metric"], f"no {label} label for {target}"
        per_pod = adapter_query(rule, NS, PODS)
        got = _until_equal(prom, per_pod, server_waiting, "the adapter rule's value")
        assert got == IN_FLIGHT - RUNNING
        (row,) = query(prom, per_pod)
        assert row["metric"] == {"pod": PODS[0]}  # one value per pod, as the HPA expects
        got = _until_equal(prom, waiting["metadata"]["query"], server_waiting, "KEDA's waiting")
        assert got == IN_FLIGHT - RUNNING
        got = _until_equal(prom, busy["metadata"]["query"], server_busy, "KEDA's busy query")
        assert got == IN_FLIGHT
        # Another deployment's series are not counted: the selector names this one.
        other = waiting["metadata"]["query"].replace(f'"{NAME}"', '"someone-else"')
        assert query(prom, other) == []


# -- KEDA mode: what the operator creates (KMock: a reconcile unit test; KEDA is not built here) --


def test_keda_mode_creates_a_scaled_object_and_no_hpa(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator, tmp_path: Path
) -> None:
    install(kubectl, tmp_path, "scaledobject")
    kubectl.apply(CRS / "valid-keda.yaml")
    scaled = wait_for(
        lambda: cluster.get("keda.sh/v1alpha1/scaledobjects", "default", "scale-to-zero"),
        "the ScaledObject",
    )
    assert problems("scaledobject", scaled) == []
    assert scaled["spec"]["minReplicaCount"] == 0
    wait_for(lambda: cluster.get("apps/v1/deployments", "default", "scale-to-zero"), "engine")
    assert (
        cluster.get("autoscaling/v2/horizontalpodautoscalers", "default", "scale-to-zero") is None
    )
