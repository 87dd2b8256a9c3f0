"""Multi-pod replicas on the real control plane with the real LeaderWorkerSet controller.

kube-apiserver v1.37 with the CRD's CEL rule; the operator as the chart's ServiceAccount; the LWS
controller (sigs.k8s.io/lws, `cluster.sh build-tools lws`) with its CRDs and webhooks from its
module; its StatefulSets run by the real StatefulSet controller, the pods scheduled onto kwok
nodes. What the tests read back is what these components did.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from lws_harness import LWS_CRD, LwsController
from op_harness import CRS, Operator, wait_for
from real_cluster import ControlPlane
from test_cluster import (
    WAIT,
    apply,
    condition,
    is_ready,
    rollout_complete,
    wait_condition,
    wait_ready,
)

from mstar.operator import manifests

pytestmark = pytest.mark.usefixtures("real_operator")
GPU_CR = CRS / "multinode-gpu.yaml"
CPU_CR = CRS / "multinode-cpu.yaml"
GROUP_INDEX = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_KIND = "leaderworkersets.leaderworkerset.x-k8s.io"


@pytest.fixture(scope="module")
def lws(
    control_plane: ControlPlane, real_operator: Operator, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LwsController]:
    """LWS installed and running; the operator restarted, since it picks the kinds it watches
    at start (as its README says for every CRD of another project)."""
    controller = LwsController(control_plane, tmp_path_factory.mktemp("lws"))
    try:
        controller.start()
        real_operator.stop()
        real_operator.start()
        yield controller
    finally:
        controller.stop()
        print(controller.log()[-4000:])


def load(path: Path) -> dict[str, Any]:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def engine_pods(cp: ControlPlane, name: str, namespace: str) -> list[dict[str, Any]]:
    return [
        p
        for p in cp.items("pods", namespace, "-l", manifests.selector_string(name))
        if not p["metadata"].get("deletionTimestamp")
    ]


def env_of(pod: dict[str, Any]) -> dict[str, str]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", "") for e in container.get("env") or []}


def test_a_layout_the_gpus_cannot_hold_is_refused_by_the_apiserver(
    control_plane: ControlPlane, namespace: str
) -> None:
    doc = load(GPU_CR)
    doc["spec"]["parallelism"]["tensorParallelSize"] = 3
    proc = control_plane.kubectl(
        "apply", "-n", namespace, "-f", "-", check=False, stdin=json.dumps(doc)
    )
    assert proc.returncode != 0
    assert "resources.gpus x nodesPerReplica must equal tensorParallelSize" in proc.stderr


def test_without_leaderworkerset_the_cr_is_degraded_until_it_is_installed(
    control_plane: ControlPlane, namespace: str, request: pytest.FixtureRequest
) -> None:
    cp = control_plane
    assert cp.get("crd", LWS_CRD, "default") is None, "this test needs a cluster without LWS"
    apply(cp, load(CPU_CR), namespace)
    cr = wait_condition(cp, "tp2-cpu", namespace, "Degraded", reason="MissingAPI")
    assert "does not serve leaderworkerset.x-k8s.io/v1" in condition(cr, "Degraded")["message"]
    assert condition(cr, "Ready")["reason"] == "LeaderWorkerSetMissing"
    assert cp.get("deployment", "tp2-cpu", namespace) is None  # never a one-pod stand-in

    request.getfixturevalue("lws")  # installs LWS, restarts the operator
    wait_condition(cp, "tp2-cpu", namespace, "Degraded", status="False")
    wait_ready(cp, "tp2-cpu", namespace, 1)
    assert len(engine_pods(cp, "tp2-cpu", namespace)) == 2


def check_groups(cp: ControlPlane, name: str, namespace: str, groups: int) -> list[dict[str, Any]]:
    """Each group a leader and a worker, each pod with the LWS environment its rank flags
    expand from; probes on leaders only. The engine pods, for further checks."""
    pods = engine_pods(cp, name, namespace)
    assert len(pods) == 2 * groups
    roles: dict[str, list[str]] = {}
    for pod in pods:
        labels, env = pod["metadata"]["labels"], env_of(pod)
        (container,) = pod["spec"]["containers"]
        index = labels[GROUP_INDEX]
        roles.setdefault(index, []).append(labels[manifests.ROLE_LABEL])
        assert env["LWS_LEADER_ADDRESS"] == f"{name}-lws-{index}.{name}-lws.{namespace}"
        assert env["LWS_GROUP_SIZE"] == "2"
        assert env["LWS_WORKER_INDEX"] == labels[WORKER_INDEX]
        leader = labels[manifests.ROLE_LABEL] == "leader"
        assert leader == (env["LWS_WORKER_INDEX"] == "0")
        args = " ".join(container["args"])
        assert "--nnodes 2 --dist-init-addr $(LWS_LEADER_ADDRESS):29500" in args
        assert args.endswith("--node-rank $(LWS_WORKER_INDEX)")
        assert ("readinessProbe" in container) == leader
    assert {k: sorted(v) for k, v in roles.items()} == {
        str(i): ["leader", "worker"] for i in range(groups)
    }
    return pods


def test_a_group_of_gpu_pods_gets_its_gpus_ranks_and_leader(
    control_plane: ControlPlane, namespace: str, lws: LwsController
) -> None:
    """One replica of 2 pods x 2 GPUs (tensor parallel 4): two pods on the GPU node, one
    group; the Service and the scale subresource pick its leader."""
    cp = control_plane
    assert lws.version() == "v0.9.0"
    doc = load(GPU_CR)
    doc["spec"]["replicas"] = 1  # the kwok GPU node has 8 GPUs, some held by other tests
    apply(cp, doc, namespace)
    cr = wait_ready(cp, "tp4", namespace, 1)
    group = cp.get(LWS_KIND, "tp4-lws", namespace)
    assert group is not None
    assert group["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    assert group["status"]["readyReplicas"] == 1
    for pod in check_groups(cp, "tp4", namespace, 1):
        (container,) = pod["spec"]["containers"]
        assert pod["spec"]["nodeName"] == "kwok-gpu-0"
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert "--device cuda" in " ".join(container["args"])
        assert "--tensor-parallel-size 4" in " ".join(container["args"])

    selector = cr["status"]["selector"]
    service = cp.get("service", "tp4", namespace)
    assert service is not None
    assert ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items()) == selector
    (leader,) = cp.items("pods", namespace, "-l", selector)
    assert leader["metadata"]["labels"][WORKER_INDEX] == "0"
    headless = cp.get("service", "tp4-lws", namespace)  # LWS's, for the pods' DNS names
    assert headless is not None and headless["spec"]["clusterIP"] == "None"


def test_scale_rollout_and_deletion_act_on_groups(
    control_plane: ControlPlane, namespace: str, lws: LwsController
) -> None:
    cp = control_plane
    apply(cp, load(CPU_CR), namespace)
    wait_ready(cp, "tp2-cpu", namespace, 1)
    cp.kubectl("scale", "msd", "tp2-cpu", "-n", namespace, "--replicas=2")
    cr = wait_ready(cp, "tp2-cpu", namespace, 2)
    group = cp.get(LWS_KIND, "tp2-cpu-lws", namespace)
    assert group is not None and group["spec"]["replicas"] == 2
    check_groups(cp, "tp2-cpu", namespace, 2)

    # What serves and what scales: the leaders, one per group; the budget: one group's pods.
    selector = cr["status"]["selector"]
    leaders = cp.items("pods", namespace, "-l", selector)
    assert sorted(p["metadata"]["labels"][GROUP_INDEX] for p in leaders) == ["0", "1"]
    path = f"/apis/mstar.dev/v1alpha1/namespaces/{namespace}/mstardeployments/tp2-cpu/scale"
    scale = json.loads(cp.kubectl("get", "--raw", path).stdout)
    assert (scale["status"]["replicas"], scale["status"]["selector"]) == (2, selector)
    budget = wait_for(
        lambda: (
            (p := cp.get("pdb", "tp2-cpu", namespace))
            and (p.get("status") or {}).get("expectedPods") == 4
            and p["status"].get("disruptionsAllowed") == 2
            and p
        ),
        "the PDB to allow one group of its four pods to go",
        WAIT,
    )
    assert budget["spec"]["maxUnavailable"] == 2

    # A new engine setting rolls group by group: a surge group first, never fewer ready leaders.
    cp.kubectl(
        "patch", "msd", "tp2-cpu", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 32}}}),
    )  # fmt: skip
    selector = f"{manifests.selector_string('tp2-cpu')},{manifests.ROLE_LABEL}=leader"
    least_ready, groups_seen = 2, set()
    deadline = time.monotonic() + 2 * WAIT
    while time.monotonic() < deadline:
        leaders = [
            p
            for p in cp.items("pods", namespace, "-l", selector)
            if not p["metadata"].get("deletionTimestamp")
        ]
        least_ready = min(least_ready, sum(is_ready(p) for p in leaders))
        groups_seen |= {p["metadata"]["labels"][GROUP_INDEX] for p in leaders}
        if rollout_complete(cp.get("msd", "tp2-cpu", namespace)):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"the rollout did not complete\n{lws.log()[-3000:]}")
    assert least_ready >= 2, "a rollout with maxUnavailable 0 dropped a ready group"
    assert "2" in groups_seen, "no surge group was created"
    pods = wait_for(
        lambda: (p := engine_pods(cp, "tp2-cpu", namespace)) and len(p) == 4 and p,
        "the surge group to go",
        WAIT,
    )
    for pod in pods:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "32"
    assert sorted({p["metadata"]["labels"][GROUP_INDEX] for p in pods}) == ["0", "1"]

    # Deletion: the garbage collector takes the LWS, its StatefulSets, Service and pods.
    cp.kubectl("delete", "msd", "tp2-cpu", "-n", namespace, "--wait=false")
    wait_for(
        lambda: (
            cp.get(LWS_KIND, "tp2-cpu-lws", namespace) is None
            and cp.items("statefulsets", namespace) == []
            and cp.get("service", "tp2-cpu-lws", namespace) is None
            and cp.items("pods", namespace, "-l", manifests.selector_string("tp2-cpu")) == []
        ),
        "the garbage collector to remove the groups",
        WAIT,
    )
