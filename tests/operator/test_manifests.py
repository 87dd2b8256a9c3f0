"""Manifest builders and status, without a cluster: the engine flag contract and edge cases."""

from __future__ import annotations

import copy
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
from mstar.operator.spec import MStarSpec, engine_config, parse_spec

CASES = sorted((ROOT / "examples").glob("*.yaml")) + sorted(CRS.glob("valid-*.yaml"))


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
    cpu = deployment_for(ROOT / "examples" / "mstardeployment-cpu.yaml")
    sneaky = copy.deepcopy(manifests.strip_none(cpu))
    sneaky["spec"]["template"]["spec"]["nodeSelector"] = {"pool": "x"}
    assert manifests.json_patch(cpu, sneaky) == [
        {"op": "remove", "path": "/spec/template/spec/nodeSelector"}
    ]
