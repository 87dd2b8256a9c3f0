"""Manifest builders and status, without a cluster: the engine flag contract and edge cases."""

from __future__ import annotations

import copy
import dataclasses
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit
from op_harness import CRS, ROOT

from mstar.engine.config import EngineConfig, parse_cli_args, to_cli_args
from mstar.operator import manifests
from mstar.operator.children import build_children, child_of
from mstar.operator.reconcile import compute_status
from mstar.operator.spec import InvalidSpec, MStarSpec, engine_config, parse_spec

CASES = sorted((ROOT / "examples").glob("mstardeployment*.yaml")) + sorted(CRS.glob("valid-*.yaml"))


def load(path: Path) -> tuple[str, MStarSpec]:
    doc, errors = admit(yaml.safe_load(path.read_text()))
    assert errors == []
    return doc["metadata"]["name"], parse_spec(doc["spec"])


def deployment_for(path: Path) -> dict[str, Any]:
    name, spec = load(path)
    deployment = child_of(build_children(name, "ns", "uid-1", spec), "Deployment", name)
    assert deployment is not None
    return deployment


def container(dep: dict[str, Any]) -> dict[str, Any]:
    return dict(dep["spec"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize("path", CASES, ids=lambda p: p.name)
def test_container_args_round_trip_through_the_engine_cli(path: Path) -> None:
    _, spec = load(path)
    args = container(deployment_for(path))["args"]
    assert args == to_cli_args(engine_config(spec), explicit=True)
    assert parse_cli_args(args) == engine_config(spec)


def test_every_engine_knob_reaches_the_flags() -> None:
    got = parse_cli_args(container(deployment_for(CRS / "valid-image-path.yaml"))["args"])
    want = EngineConfig(
        model="/opt/models/qwen2-0.5b",
        served_model_name="baked-model",
        host="0.0.0.0",
        port=8000,
        device="cuda",
        num_pages=1000,
        page_size=32,
        max_num_seqs=16,
        max_num_batched_tokens=4096,
        max_model_len=2048,
        cuda_graph_batch_sizes=[1, 2, 4, 8, 16],
        enforce_eager=True,
        eviction_policy="priority",
        host_offload_gb=0.0,
        enable_prefix_caching=False,
        dtype="bfloat16",
        max_waiting_requests=32,
        shutdown_grace_seconds=90.0,
        seed=7,
        tensor_parallel_size=2,
    )
    assert got == want
    dep = deployment_for(CRS / "valid-image-path.yaml")
    assert dep["spec"]["replicas"] == 0
    limits = container(dep)["resources"]["limits"]
    assert limits["nvidia.com/mig-3g.40gb"] == "2" and "nvidia.com/gpu" not in limits
    assert container(dep)["resources"]["requests"]["cpu"] == "1500m"
    # The kubelet waits for the preStop hook (20 s at most), then the drain (90 s), then a margin.
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 20 + 90 + 10
    hook = container(dep)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == [
        "mstar-engine",
        "prestop",
        "--port",
        "8000",
        "--quiet-seconds",
        "2.0",
        "--timeout-seconds",
        "20.0",
    ]
    assert "prometheus.io/scrape" not in dep["spec"]["template"]["metadata"]["annotations"]


def test_cpu_example_requests_no_gpu() -> None:
    dep = deployment_for(ROOT / "examples" / "mstardeployment-cpu.yaml")
    c = container(dep)
    assert not any("gpu" in key for key in c["resources"]["limits"])
    assert parse_cli_args(c["args"]).device == "cpu"
    assert parse_cli_args(c["args"]).model is None  # the engine's packaged model
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["OTEL_TRACES_EXPORTER"] == "none"
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in env


def test_hugging_face_source_uses_an_init_container_and_the_token_secret() -> None:
    dep = deployment_for(CRS / "valid-huggingface.yaml")
    pod = dep["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["hf", "download", "meta-llama/Llama-3.2-1B-Instruct"]
    assert init["args"] == ["--revision", "main", "--local-dir", "/models/hf"]
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert parse_cli_args(container(dep)["args"]).model == "/models/hf"
    models = next(v for v in pod["volumes"] if v["name"] == "models")
    assert models["emptyDir"] == {"sizeLimit": "20Gi"}
    name, spec = load(CRS / "valid-huggingface.yaml")
    service = manifests.build_service(name, "ns", "u", spec)
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80


def test_drift_ignores_server_defaults_and_sees_hand_edits() -> None:
    desired = deployment_for(ROOT / "examples" / "mstardeployment.yaml")
    live = copy.deepcopy(manifests.strip_none(desired))
    live["metadata"]["uid"] = "x"
    live["spec"]["template"]["spec"]["dnsPolicy"] = "ClusterFirst"  # server default
    live["spec"]["template"]["spec"]["containers"][0]["terminationMessagePath"] = "/dev/term"
    live["status"] = {"replicas": 2}
    assert manifests.drift(desired, live) == []
    edited = copy.deepcopy(live)
    edited["spec"]["template"]["spec"]["containers"][0]["args"].append("--seed")
    edited["spec"]["template"]["spec"]["nodeSelector"] = None
    assert manifests.drift(desired, edited) == [
        "spec.template.spec.containers[0].args",
        "spec.template.spec.nodeSelector",
    ]
    cpu = deployment_for(ROOT / "examples" / "mstardeployment-cpu.yaml")
    sneaky = copy.deepcopy(manifests.strip_none(cpu))
    sneaky["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "x"}  # must be absent
    assert manifests.drift(cpu, sneaky) == ["spec.template.spec.nodeSelector"]


def _cr(generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": generation},
        "status": status or {},
    }


def _dep(ready: int, updated: int, replicas: int, **extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": 2},
        "status": {
            "observedGeneration": 3,
            "readyReplicas": ready,
            "updatedReplicas": updated,
            "replicas": replicas,
            **extra,
        },
    }


def _conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def test_status_follows_the_rollout() -> None:
    _, spec = load(ROOT / "examples" / "mstardeployment.yaml")  # replicas: 2
    rolling = compute_status(_cr(), _dep(1, 1, 3), spec=spec)
    assert _conds(rolling) == {
        "Ready": ("False", "ReplicasNotReady"),
        "Progressing": ("True", "RollingOut"),
        "Degraded": ("False", "AsExpected"),
    }
    done = compute_status(_cr(status=rolling), _dep(2, 2, 2), spec=spec)
    assert _conds(done)["Ready"] == ("True", "AllReplicasReady")
    assert _conds(done)["Progressing"] == ("False", "RolloutComplete")
    assert done["readyReplicas"] == 2 and done["selector"].startswith("app.kubernetes.io/name=")
    again = compute_status(_cr(status=done), _dep(2, 2, 2), spec=spec)
    assert (
        again["conditions"][0]["lastTransitionTime"] == done["conditions"][0]["lastTransitionTime"]
    )
    stuck = _dep(
        1,
        1,
        2,
        conditions=[
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
        ],
    )
    assert _conds(compute_status(_cr(), stuck, spec=spec))["Degraded"] == (
        "True",
        "ProgressDeadlineExceeded",
    )
    invalid = compute_status(_cr(), _dep(2, 2, 2), spec=None, problems=["spec.x: bad"])
    assert _conds(invalid)["Degraded"] == ("True", "InvalidSpec")
    assert _conds(invalid)["Ready"] == ("True", "AllReplicasReady")  # the old pods still serve


def test_json_patch_restores_exactly_and_converges() -> None:
    import jsonpatch

    desired = deployment_for(ROOT / "examples" / "mstardeployment.yaml")
    live = copy.deepcopy(manifests.strip_none(desired))
    pod = live["spec"]["template"]
    pod["spec"]["dnsPolicy"] = "ClusterFirst"  # a server default: must survive
    engine = pod["spec"]["containers"][0]
    engine["env"].append({"name": "INJECTED", "value": "1"})  # merged lists would keep this
    engine["args"] = ["--max-num-seqs", "1"]
    pod["metadata"]["annotations"]["prometheus.io/scrape"] = "false"  # "/" in the key
    del pod["spec"]["priorityClassName"]
    ops = manifests.json_patch(desired, live)
    fixed = jsonpatch.apply_patch(live, ops)
    assert manifests.drift(desired, fixed) == []
    assert manifests.json_patch(desired, fixed) == []  # converged: no patch loop
    assert fixed["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirst"
    assert all(e["name"] != "INJECTED" for e in container(fixed)["env"])
    assert {
        "op": "add",
        "path": "/spec/template/metadata/annotations/prometheus.io~1scrape",
        "value": "true",
    } in ops
    # One changed list item (a new engine setting): replaced in place, the list keeps its
    # length, one patch converges (an "add" would insert, and a second patch follow).
    edited = copy.deepcopy(manifests.strip_none(desired))
    container(edited)["args"][3] = "changed"
    ops = manifests.json_patch(desired, edited)
    assert [op["op"] for op in ops] == ["replace"]
    fixed = jsonpatch.apply_patch(edited, ops)
    assert container(fixed)["args"] == container(desired)["args"]
    assert manifests.json_patch(desired, fixed) == []
    cpu = deployment_for(ROOT / "examples" / "mstardeployment-cpu.yaml")
    sneaky = copy.deepcopy(manifests.strip_none(cpu))
    sneaky["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "x"}
    assert manifests.json_patch(cpu, sneaky) == [
        {"op": "remove", "path": "/spec/template/spec/nodeSelector"}
    ]


def _children(path: Path) -> tuple[str, list[Any]]:
    name, spec = load(path)
    return name, build_children(name, "ns", "uid-1", spec)


def test_every_engine_setting_is_rendered_explicitly() -> None:
    """Defaults too: an engine image whose built-in defaults differ cannot change a deployment."""
    path = ROOT / "examples" / "mstardeployment-cpu.yaml"  # sets only numPages, hostOffloadGiB
    _, spec = load(path)
    args = container(deployment_for(path))["args"]
    flags = {a.removeprefix("--").removeprefix("no-") for a in args if a.startswith("--")}
    config = engine_config(spec)
    expected = {
        f.name.replace("_", "-")
        for f in dataclasses.fields(EngineConfig)
        if getattr(config, f.name) is not None
    }
    assert flags == expected
    assert {"max-num-seqs", "page-size", "cuda-graph-batch-sizes", "seed"} <= flags
    assert "max-model-len" not in flags  # unset means "the model's own": nothing to render
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.9"
    assert "--enable-prefix-caching" in args
    # Rendered against other defaults, the flags still mean exactly this spec.
    assert parse_cli_args(args) == config


def test_rollout_safety_in_the_pod_spec() -> None:
    dep = deployment_for(ROOT / "examples" / "mstardeployment.yaml")
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    pod = dep["spec"]["template"]["spec"]
    hook = container(dep)["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["mstar-engine", "prestop"]
    assert hook[hook.index("--quiet-seconds") + 1] == "5.0"  # the CRD's defaults
    assert hook[hook.index("--timeout-seconds") + 1] == "30.0"
    assert pod["terminationGracePeriodSeconds"] == 30 + 30 + 10
    assert container(dep)["readinessProbe"]["httpGet"]["path"] == "/ready"
    # A hung engine (progress-checking /health) is restarted within 15 s of going red.
    live = container(dep)["livenessProbe"]
    assert live["httpGet"]["path"] == "/health"
    assert live["periodSeconds"] * live["failureThreshold"] + live["timeoutSeconds"] <= 15


@pytest.mark.parametrize(("replicas", "pdb"), [(0, False), (1, False), (2, True), (5, True)])
def test_pdb_only_with_several_replicas(replicas: int, pdb: bool) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "mstardeployment-cpu.yaml").read_text())
    doc["spec"]["replicas"] = replicas
    defaulted, errors = admit(doc)
    assert errors == []
    spec = parse_spec(defaulted["spec"])
    budget = child_of(build_children("m", "ns", "u", spec), "PodDisruptionBudget", "m")
    assert (budget is not None) == pdb
    if budget is not None:
        assert budget["spec"]["maxUnavailable"] == 1
        assert budget["spec"]["selector"]["matchLabels"] == manifests.selector_labels("m")


def test_keda_mode_replaces_the_hpa_with_a_scaled_object() -> None:
    name, children = _children(CRS / "valid-keda.yaml")
    assert child_of(children, "HorizontalPodAutoscaler", name) is None
    scaled = child_of(children, "ScaledObject", name)
    assert scaled is not None
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "mstar.dev/v1alpha1",
        "kind": "MStarDeployment",
        "name": name,
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 4, 600)
    waiting, busy, wake = spec["triggers"]
    assert waiting["metadata"]["threshold"] == "2"
    assert busy["metadata"]["threshold"] == "32"  # a replica is full at maxNumSeqs running
    sel = f'namespace="ns",mstar_deployment="{name}"'
    assert waiting["metadata"]["query"] == f"sum(mstar:num_requests_waiting{{{sel}}})"
    assert "mstar:num_requests_running" in busy["metadata"]["query"]
    assert wake["name"] == "wake"  # extraTriggers pass through unchanged
    hpa_name, hpa_children = _children(ROOT / "examples" / "mstardeployment.yaml")
    assert child_of(hpa_children, "ScaledObject", hpa_name) is None
    assert child_of(hpa_children, "HorizontalPodAutoscaler", hpa_name) is not None


@pytest.mark.parametrize(
    ("patch", "problem"),
    [
        ({"autoscaling": {"minReplicas": 0, "maxReplicas": 3}}, "needs mode: keda"),
        ({"autoscaling": {"mode": "keda", "maxReplicas": 3}}, "keda.prometheusAddress: required"),
        ({"drain": {"quietSeconds": 40, "preStopTimeoutSeconds": 30}}, "could never see the pod"),
    ],
)
def test_unservable_scaling_and_drain_specs_are_named(patch: dict[str, Any], problem: str) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "mstardeployment-cpu.yaml").read_text())
    doc["spec"].update(patch)
    defaulted, errors = admit(doc)
    assert errors == []
    with pytest.raises(InvalidSpec, match=problem):
        parse_spec(defaulted["spec"])


BUILT_IN = {
    "ConfigMap",
    "Service",
    "Deployment",
    "PodDisruptionBudget",
    "HorizontalPodAutoscaler",
    "ServiceAccount",
    "RoleBinding",
}


def test_rendered_built_in_children_validate_strictly(tmp_path: Path) -> None:
    """What the operator creates for every example and test CR passes kubernetes-validate."""
    if shutil.which("kubernetes-validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    docs = []
    for path in CASES:
        _, children = _children(path)
        docs += [
            manifests.strip_none(c.desired) for c in children if c.desired and c.kind in BUILT_IN
        ]
    assert {d["kind"] for d in docs} == BUILT_IN
    out = tmp_path / "children.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run(
        ["kubernetes-validate", "--strict", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ERROR" not in proc.stdout + proc.stderr
