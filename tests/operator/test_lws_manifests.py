"""Multi-pod replicas without a cluster: the parallel layout, its LeaderWorkerSet, the engine
flags each pod gets, what selects leaders only, and the reconcile pass around them.

The same objects meet the real LeaderWorkerSet controller in test_lws_cluster.py.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_schema import admit
from op_harness import CRS, ROOT

from mstar.engine.config import parse_cli_args, to_cli_args
from mstar.operator import manifests
from mstar.operator.children import build_children, child_of
from mstar.operator.kube import MissingAPI
from mstar.operator.lws import LEADER_ONLY, lws_name
from mstar.operator.reconcile import reconcile
from mstar.operator.router import build_inference_pool
from mstar.operator.spec import InvalidSpec, MStarSpec, engine_config, parse_spec

GPU_CR = CRS / "multinode-gpu.yaml"
CPU_CR = CRS / "multinode-cpu.yaml"
SINGLE_CR = ROOT / "examples" / "mstardeployment-cpu.yaml"


def load(path: Path, **spec: Any) -> tuple[str, MStarSpec]:
    doc = yaml.safe_load(path.read_text())
    doc["spec"].update(spec)
    defaulted, errors = admit(doc)
    assert errors == []
    return doc["metadata"]["name"], parse_spec(defaulted["spec"])


def group_of(path: Path, **spec: Any) -> tuple[str, MStarSpec, dict[str, Any]]:
    name, parsed = load(path, **spec)
    lws = child_of(build_children(name, "ns", "uid-1", parsed), "LeaderWorkerSet", lws_name(name))
    assert lws is not None
    return name, parsed, lws


def kubelet_expand(args: list[str], env: dict[str, str]) -> list[str]:
    """The kubelet's `$(NAME)` expansion of container args from the container's environment."""
    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m.group(1)], a) for a in args]


def test_one_pod_per_replica_is_a_deployment_several_a_leader_worker_set() -> None:
    name, spec = load(SINGLE_CR)
    children = build_children(name, "ns", "u", spec)
    assert child_of(children, "Deployment", name) is not None
    assert child_of(children, "LeaderWorkerSet", lws_name(name)) is None
    name, spec, lws = group_of(GPU_CR)
    assert child_of(build_children(name, "ns", "u", spec), "Deployment", name) is None
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["name"] == "tp4-lws"  # "tp4" is the engine Service's name
    (ref,) = lws["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["controller"]) == ("MStarDeployment", name, True)
    assert lws["spec"]["replicas"] == 2  # groups
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2  # pods per group
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    rolling = lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"]
    assert (rolling["maxUnavailable"], rolling["maxSurge"]) == (0, 1)


def test_each_pod_of_a_group_gets_its_gpus_and_its_rank_from_the_lws_environment() -> None:
    _, spec, lws = group_of(GPU_CR)
    template = lws["spec"]["leaderWorkerTemplate"]
    config = engine_config(spec)
    assert (config.tensor_parallel_size, config.nnodes) == (4, 2)
    assert config.dist_init_addr == "$(LWS_LEADER_ADDRESS):29500"
    for role, index in (("leaderTemplate", "0"), ("workerTemplate", "1")):
        (container,) = template[role]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        args = container["args"]
        assert args == [*to_cli_args(config, explicit=True), "--node-rank", "$(LWS_WORKER_INDEX)"]
        # What the pod webhook of LWS injects, as the kubelet expands it:
        env = {"LWS_LEADER_ADDRESS": "tp4-lws-1.tp4-lws.ns", "LWS_WORKER_INDEX": index}
        parsed = parse_cli_args(kubelet_expand(args, env))
        assert parsed.node_rank == int(index)
        assert parsed.dist_init_addr == "tp4-lws-1.tp4-lws.ns:29500"
        assert (parsed.tensor_parallel_size, parsed.nnodes, parsed.device) == (4, 2, "cuda")
        pod = template[role]["spec"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}


def test_only_the_leader_serves_http() -> None:
    _, _, lws = group_of(GPU_CR)
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    assert leader["metadata"]["labels"][manifests.ROLE_LABEL] == "leader"
    assert worker["metadata"]["labels"][manifests.ROLE_LABEL] == "worker"
    (lead,) = leader["spec"]["containers"]
    (work,) = worker["spec"]["containers"]
    assert lead["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert lead["ports"][0]["containerPort"] == 8000
    assert lead["lifecycle"]["preStop"]["exec"]["command"][:2] == ["mstar-engine", "prestop"]
    assert all(work[key] is None for key in LEADER_ONLY)  # None: must be absent
    assert leader["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert "prometheus.io/scrape" not in worker["metadata"]["annotations"]
    # A spec change reaches both templates, so the LWS controller rolls whole groups.
    hash_key = manifests.CONFIG_HASH_ANNOTATION
    assert (
        leader["metadata"]["annotations"][hash_key] == worker["metadata"]["annotations"][hash_key]
    )
    _, _, changed = group_of(GPU_CR, engine={"numPages": 2048, "hostOffloadGiB": 0})
    new = changed["spec"]["leaderWorkerTemplate"]
    assert (
        new["workerTemplate"]["metadata"]["annotations"][hash_key]
        != (worker["metadata"]["annotations"][hash_key])
    )


def test_service_router_and_hpa_select_leaders_the_budget_counts_groups() -> None:
    routed = {"router": {"gateway": {"name": "gw"}}, "autoscaling": {"maxReplicas": 4}}
    name, spec = load(GPU_CR, **routed)
    children = build_children(name, "ns", "u", spec)
    leaders = {**manifests.selector_labels(name), manifests.ROLE_LABEL: "leader"}
    service = child_of(children, "Service", name)
    assert service is not None and service["spec"]["selector"] == leaders
    assert build_inference_pool(name, "ns", "u", spec)["spec"]["selector"]["matchLabels"] == leaders
    assert manifests.selector_string(name, spec) == ",".join(f"{k}={v}" for k, v in leaders.items())
    hpa = child_of(children, "HorizontalPodAutoscaler", name)
    assert hpa is not None and hpa["spec"]["scaleTargetRef"]["kind"] == "MStarDeployment"
    budget = child_of(children, "PodDisruptionBudget", name)
    assert budget is not None
    assert budget["spec"]["selector"]["matchLabels"] == manifests.selector_labels(name)
    assert budget["spec"]["maxUnavailable"] == 2  # one group's pods
    # One pod per replica: every engine pod serves, one pod at a time may go.
    single, single_spec = load(SINGLE_CR, replicas=2)
    assert manifests.serving_selector(single, single_spec) == manifests.selector_labels(single)
    single_budget = child_of(
        build_children(single, "ns", "u", single_spec), "PodDisruptionBudget", single
    )
    assert single_budget is not None and single_budget["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize(
    ("gpus", "parallelism", "problem"),
    [
        (2, {"tensorParallelSize": 2, "nodesPerReplica": 2}, r"= 4 GPUs per replica, but .* is 2"),
        (1, {"tensorParallelSize": 4}, r"\(1\) x nodesPerReplica \(1\) = 1 GPUs per replica"),
        (2, {}, "tensorParallelSize is 1"),  # a second GPU would sit idle
        (0, {"tensorParallelSize": 3, "nodesPerReplica": 2}, "not a multiple of nodesPerReplica"),
    ],
)
def test_a_bad_layout_is_named(gpus: int, parallelism: dict[str, int], problem: str) -> None:
    doc = yaml.safe_load(SINGLE_CR.read_text())
    doc["spec"]["resources"]["gpus"] = gpus
    doc["spec"]["parallelism"] = parallelism
    defaulted, errors = admit(doc)
    assert errors == []  # the apiserver's CEL rule refuses it too (test_lws_cluster.py)
    with pytest.raises(InvalidSpec, match=problem):
        parse_spec(defaulted["spec"])


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (["--tensor-parallel-size", "3", "--nnodes", "2"], "must be a multiple of --nnodes"),
        (["--nnodes", "2", "--tensor-parallel-size", "2"], "--dist-init-addr is required"),
        (["--node-rank", "1"], r"--node-rank must be in \[0, --nnodes\)"),
        (["--dist-init-addr", "leader"], "must be HOST:PORT"),
        (["--tensor-parallel-size", "0"], "must be >= 1"),
        (["--tensor-parallel-size", "2", "--enable-lora"], "not served with --tensor-parallel"),
    ],
)
def test_engine_refuses_an_inconsistent_layout(flags: list[str], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_cli_args(flags)


def test_group_pod_templates_validate_strictly(tmp_path: Path) -> None:
    """kubernetes-validate knows no LWS; its two pod templates are checked as PodTemplates."""
    if shutil.which("kubernetes-validate") is None:
        pytest.skip("kubernetes-validate is not installed (pip install kubernetes-validate)")
    docs = []
    for path in (GPU_CR, CPU_CR):
        name, _, lws = group_of(path)
        for role, template in lws["spec"]["leaderWorkerTemplate"].items():
            if isinstance(template, dict):
                docs.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": f"{name}-{role.lower()}"},
                        "template": manifests.strip_none(template),
                    }
                )
    out = tmp_path / "templates.yaml"
    out.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run(
        ["kubernetes-validate", "--strict", str(out)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


class FakeKube:
    """The `Kube` calls a reconcile pass makes, on dicts; `serves_lws` False is a cluster
    without the LeaderWorkerSet CRD (a create answers 404, a read finds nothing)."""

    def __init__(self, cr: dict[str, Any], serves_lws: bool) -> None:
        self.cr, self.serves_lws = cr, serves_lws
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def get_cr(self, namespace: str, name: str) -> dict[str, Any]:
        return copy.deepcopy(self.cr)

    def patch_cr_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.cr["status"] = {**(self.cr.get("status") or {}), **status}

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return copy.deepcopy(self.objects.get((kind, name)))

    def create(self, kind: str, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        if kind == "LeaderWorkerSet" and not self.serves_lws:
            raise MissingAPI(404, "NotFound", "LeaderWorkerSet: this cluster does not serve it")
        self.objects[(kind, body["metadata"]["name"])] = copy.deepcopy(body)
        return body

    def patch(self, kind: str, namespace: str, name: str, ops: list[Any]) -> dict[str, Any]:
        """RFC 6902 add / replace / remove, as the reconciler sends them."""
        obj = self.objects[(kind, name)]
        for op in ops:
            *parents, last = [int(p) if p.isdigit() else p for p in op["path"].split("/")[1:]]
            node: Any = obj
            for part in parents:
                node = node[part]
            if op["op"] == "remove":
                del node[last]
            else:
                node[last] = copy.deepcopy(op["value"])
        return copy.deepcopy(obj)

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        return self.objects.pop((kind, name), None) is not None


def _cr(path: Path, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    doc["spec"].update(spec)
    doc["metadata"].update({"namespace": "ns", "uid": "u-1", "generation": 1})
    return doc


def _condition(cr: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in cr["status"]["conditions"] if c["type"] == kind)


def test_without_the_lws_crd_the_cr_is_degraded_and_the_old_deployment_keeps_serving() -> None:
    cr = _cr(SINGLE_CR)
    kube = FakeKube(cr, serves_lws=False)
    reconcile(kube, cr)  # type: ignore[arg-type]
    assert ("Deployment", "smollm2-cpu") in kube.objects
    # The user asks for two pods per replica; this cluster has no LeaderWorkerSet.
    kube.cr["spec"]["parallelism"] = {"tensorParallelSize": 2, "nodesPerReplica": 2}
    kube.cr["metadata"]["generation"] = 2
    reconcile(kube, kube.cr)  # type: ignore[arg-type]
    degraded = _condition(kube.cr, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "MissingAPI")
    assert "LeaderWorkerSet" in degraded["message"]
    assert ("Deployment", "smollm2-cpu") in kube.objects  # not deleted: nothing would serve
    # Once LWS is installed the next pass switches over: the group first, then the Deployment goes.
    kube.serves_lws = True
    reconcile(kube, kube.cr)  # type: ignore[arg-type]
    assert ("LeaderWorkerSet", "smollm2-cpu-lws") in kube.objects
    assert ("Deployment", "smollm2-cpu") not in kube.objects
    assert _condition(kube.cr, "Degraded")["status"] == "False"
    assert kube.cr["status"]["selector"].endswith(f"{manifests.ROLE_LABEL}=leader")


def test_a_bad_layout_is_degraded_and_creates_nothing() -> None:
    cr = _cr(SINGLE_CR, parallelism={"tensorParallelSize": 3, "nodesPerReplica": 2})
    kube = FakeKube(cr, serves_lws=True)
    reconcile(kube, cr)  # type: ignore[arg-type]
    degraded = _condition(kube.cr, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InvalidSpec")
    assert "tensorParallelSize (3) is not a multiple of nodesPerReplica (2)" in degraded["message"]
    assert kube.objects == {}


def test_status_reads_the_engine_workload_not_the_pickers_deployment() -> None:
    """A routed CR has two Deployments: the engine's and its endpoint picker's."""
    cr = _cr(SINGLE_CR, replicas=2, router={"path": "/"})
    kube = FakeKube(cr, serves_lws=True)
    reconcile(kube, cr)  # type: ignore[arg-type]
    engine = kube.objects[("Deployment", "smollm2-cpu")]
    engine["metadata"]["generation"] = 1
    engine["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2}
    engine["status"]["updatedReplicas"] = 2
    kube.objects[("Deployment", "smollm2-cpu-epp")]["status"] = {"replicas": 1, "readyReplicas": 1}
    reconcile(kube, kube.cr)  # type: ignore[arg-type]
    assert (kube.cr["status"]["replicas"], kube.cr["status"]["readyReplicas"]) == (2, 2)
    assert _condition(kube.cr, "Ready")["status"] == "True"
