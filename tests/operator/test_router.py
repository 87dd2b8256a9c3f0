"""spec.router: the InferencePool, its endpoint picker and the HTTPRoute, checked against schemas
written from the Gateway API Inference Extension's documentation, against the metric names the
real engine server exports. The operator creating and removing them on a real control plane:
tests/operator/test_cluster.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit
from extension_schemas import load, problems
from live_server import LiveServer, make_engine
from op_harness import ROOT
from prometheus_client.parser import text_string_to_metric_families

from mstar.operator import manifests, router
from mstar.operator.children import build_children, child_of
from mstar.operator.spec import parse_spec

ROUTED = ROOT / "examples" / "mstardeployment-routed.yaml"
NAME = "smollm2-routed"
NS = "default"


def routed_children() -> list[manifests.Child]:
    doc, errors = admit(yaml.safe_load(ROUTED.read_text()))
    assert errors == []
    return build_children(NAME, NS, "uid-1", parse_spec(doc["spec"]))


def desired(kind: str, name: str) -> dict[str, Any]:
    obj = child_of(routed_children(), kind, name)
    assert obj is not None, (kind, name)
    return obj


def epp_config() -> dict[str, Any]:
    config_map = desired("ConfigMap", router.epp_name(NAME))
    parsed = yaml.safe_load(config_map["data"][router.EPP_CONFIG_FILE])
    assert isinstance(parsed, dict)
    return parsed


def test_pool_and_route_match_the_extension_schemas() -> None:
    pool = desired("InferencePool", NAME)
    route = desired("HTTPRoute", NAME)
    assert problems("inferencepool", pool) == []
    assert problems("httproute", route) == []
    key = re.compile(load("inferencepool")["labelKeyPattern"])
    assert all(key.match(k) for k in pool["spec"]["selector"]["matchLabels"])

    # The pool selects the engine pods and only them, on the port the engine listens on.
    selector = pool["spec"]["selector"]["matchLabels"].items()
    engine = desired("Deployment", NAME)["spec"]["template"]
    picker = desired("Deployment", router.epp_name(NAME))["spec"]["template"]
    assert selector <= engine["metadata"]["labels"].items()
    assert not selector <= picker["metadata"]["labels"].items()
    (port,) = engine["spec"]["containers"][0]["ports"]
    assert pool["spec"]["targetPorts"] == [{"number": port["containerPort"]}]
    # Its endpoint picker is the EPP Service, on that Service's gRPC port.
    ref = pool["spec"]["endpointPickerRef"]
    service = desired("Service", router.epp_name(NAME))
    assert (ref["kind"], ref["name"]) == ("Service", service["metadata"]["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert service["spec"]["selector"].items() <= picker["metadata"]["labels"].items()
    assert ref["failureMode"] == "FailOpen"
    # The route sends the gateway's traffic to the pool.
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": NAME}
    ]
    assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"


def test_schemas_reject_what_the_extension_rejects() -> None:
    """The hand-written schemas are not vacuous: each catches a documented violation."""
    pool = desired("InferencePool", NAME)
    bad_mode = {
        **pool,
        "spec": {**pool["spec"], "endpointPickerRef": {"name": "x", "failureMode": "Open"}},
    }
    assert problems("inferencepool", bad_mode)
    no_ports = {**pool, "spec": {**pool["spec"], "targetPorts": []}}
    assert problems("inferencepool", no_ports)
    typo = {**pool, "spec": {**pool["spec"], "targetPort": [{"number": 8000}]}}
    assert problems("inferencepool", typo)
    route = desired("HTTPRoute", NAME)
    slow = yaml.safe_load(yaml.safe_dump(route))
    slow["spec"]["rules"][0]["timeouts"]["request"] = "1.5m"  # GEP-2257: no fractions
    assert problems("httproute", slow)


def test_endpoint_picker_config_is_complete_and_reads_mstar_metrics() -> None:
    """What the config says; the real picker decoding and running it: test_epp.py."""
    config = epp_config()
    plugins = {p.get("name", p["type"]): p for p in config["plugins"]}
    sources = config["dataLayer"]["sources"]
    refs = [p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]]
    refs += [s["pluginRef"] for s in sources]
    refs += [e["pluginRef"] for s in sources for e in s["extractors"]]
    assert set(refs) <= set(plugins), "a pluginRef names no plugin"
    weights = {p["pluginRef"]: p.get("weight") for p in config["schedulingProfiles"][0]["plugins"]}
    assert weights == {
        "stale-metrics-filter": None,
        "queue-scorer": 2,
        "kv-cache-utilization-scorer": 2,
        "prefix-cache-scorer": 3,
        "max-score-picker": None,
    }
    assert plugins["prefix-cache-scorer"]["parameters"]["blockSizeTokens"] == 16  # pageSize
    # The filter drops stale endpoints only: its load thresholds are out of reach.
    stale = plugins["stale-metrics-filter"]
    assert stale["type"] == "utilization-detector"
    assert stale["parameters"]["metricsStalenessThreshold"] == "1.0s"
    assert stale["parameters"]["kvCacheUtilThreshold"] * (1 + stale["parameters"]["headroom"]) > 1
    extractor = plugins["core-metrics-extractor"]["parameters"]
    (engine,) = extractor["engineConfigs"]
    assert engine["name"] == extractor["defaultEngine"] == "mstar"
    pod_labels = desired("Deployment", NAME)["spec"]["template"]["metadata"]["labels"]
    assert pod_labels[extractor["engineLabelKey"]] == "mstar"
    assert engine["queuedRequestsSpec"] == "mstar:num_requests_waiting"
    assert engine["kvUsageSpec"] == "mstar:kv_cache_usage_perc"
    assert engine["cacheInfoSpec"] == "mstar:cache_config_info"

    # The picker process gets that file, the pool it serves and a token for reading pods.
    picker = desired("Deployment", router.epp_name(NAME))["spec"]["template"]["spec"]
    (epp,) = picker["containers"]
    args = epp["args"]
    assert args[args.index("--pool-name") + 1] == NAME
    assert args[args.index("--pool-namespace") + 1] == NS
    config_path = args[args.index("--config-file") + 1]
    (mount,) = epp["volumeMounts"]
    assert config_path == f"{mount['mountPath']}/{router.EPP_CONFIG_FILE}"
    assert picker["serviceAccountName"] == router.epp_name(NAME)
    binding = desired("RoleBinding", router.epp_name(NAME))
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": router.epp_name(NAME), "namespace": NS}
    ]
    assert binding["roleRef"]["name"] == router.DEFAULT_EPP_CLUSTER_ROLE


@pytest.fixture()
def loaded_server(tiny_llama_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(tiny_llama_dir, max_num_seqs=2)) as live:
        yield live


def test_the_real_server_exports_every_metric_the_picker_reads(loaded_server: LiveServer) -> None:
    """Each metric spec of the picker's config names a gauge on the engine's real /metrics."""
    (engine,) = [
        p["parameters"]["engineConfigs"][0]
        for p in epp_config()["plugins"]
        if p["type"] == "core-metrics-extractor"
    ]
    status, text = loaded_server.get("/metrics")
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    specs = {key: value for key, value in engine.items() if key.endswith("Spec") and value}
    gauges = {"queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec"}
    assert set(specs) == {*gauges, "cacheInfoSpec"}
    for key, name in specs.items():
        family = families.get(name)
        assert family is not None, f"{key}: {name} is not on the server's /metrics"
        assert family.type == "gauge", (name, family.type)
    for key in gauges:
        assert [s.labels for s in families[specs[key]].samples] == [{"model_name": "tiny"}]
    kv = families["mstar:kv_cache_usage_perc"].samples[0].value
    assert 0.0 <= kv <= 1.0  # a fraction, as the KV-cache scorer expects
    # The picker reads the page size and count from the info gauge's labels (vLLM's names).
    (info,) = families["mstar:cache_config_info"].samples
    assert info.value == 1
    engine_kv = loaded_server.engine.kv
    assert int(info.labels["block_size"]) == engine_kv.page_size == 4
    assert int(info.labels["num_gpu_blocks"]) == engine_kv.num_pages
