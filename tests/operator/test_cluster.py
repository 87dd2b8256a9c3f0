"""The operator end to end on a real control plane (scripts/cluster.sh): kube-apiserver v1.37 with
its schema, CEL and RBAC; the Deployment, ReplicaSet, disruption, HPA and garbage-collector
controllers; the scheduler; kwok's fake nodes (pods are Running but not Ready for 5 s).

The operator runs as a process with the token of the chart's own ServiceAccount; the tests drive
the cluster with real kubectl and helm. Nothing here is emulated: a reply comes from the real
component, or the test fails.
"""

from __future__ import annotations

import json
import subprocess
import time
from typing import Any

import pytest
import yaml
from op_harness import CRS, Operator, wait_for
from real_cluster import RELEASE, RELEASE_NAMESPACE, ROOT, ControlPlane

from mstar.operator import manifests, router

EXAMPLES = ROOT / "examples"
WAIT = 120.0  # 2 shared cores: the control plane, the operator and the tests compete
MANAGED = "app.kubernetes.io/managed-by=mstar-operator"
CHILD_KINDS = (
    "deployments,replicasets,pods,services,configmaps,poddisruptionbudgets,horizontalpodautoscalers"
)

pytestmark = pytest.mark.usefixtures("real_operator")


def load(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    assert isinstance(doc, dict)
    return doc


def apply(cp: ControlPlane, doc: dict[str, Any], namespace: str) -> None:
    cp.kubectl("apply", "-n", namespace, "-f", "-", stdin=json.dumps(doc))


def condition(cr: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in ((cr or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return {}


def wait_ready(cp: ControlPlane, name: str, namespace: str, replicas: int) -> dict[str, Any]:
    """The CR once it reports Ready with `replicas` ready pods on its current generation."""

    def ready() -> dict[str, Any] | None:
        cr = cp.get("msd", name, namespace)
        status = (cr or {}).get("status") or {}
        if (
            cr is not None
            and condition(cr, "Ready").get("status") == "True"
            and status.get("readyReplicas") == replicas
            and status.get("observedGeneration") == cr["metadata"]["generation"]
        ):
            return cr
        return None

    return wait_for(ready, f"{namespace}/{name} Ready with {replicas} replicas", WAIT)


def rollout_complete(cr: dict[str, Any] | None) -> bool:
    """Ready on the current generation, and the rollout to it done."""
    return bool(
        cr
        and cr["status"].get("observedGeneration") == cr["metadata"]["generation"]
        and condition(cr, "Ready").get("status") == "True"
        and condition(cr, "Progressing").get("reason") == "RolloutComplete"
    )


def wait_condition(cp: ControlPlane, name: str, namespace: str, kind: str, **want: str) -> Any:
    """The CR once its `kind` condition has each field in `want` (`message`: a substring)."""

    def matches() -> dict[str, Any] | None:
        cr = cp.get("msd", name, namespace)
        cond = condition(cr, kind)
        ok = all(
            v in str(cond.get(k, "")) if k == "message" else cond.get(k) == v
            for k, v in want.items()
        )
        return cr if ok else None

    return wait_for(matches, f"{namespace}/{name} {kind} {want}", WAIT)


def pods(cp: ControlPlane, name: str, namespace: str) -> list[dict[str, Any]]:
    return cp.items("pods", namespace, "-l", manifests.selector_string(name))


def is_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions") or []
    ) and not pod["metadata"].get("deletionTimestamp")


def managed(cp: ControlPlane, namespace: str) -> list[str]:
    return [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in cp.items(CHILD_KINDS, namespace, "-l", MANAGED)
    ]


def events(cp: ControlPlane, namespace: str, reason: str) -> list[dict[str, Any]]:
    return cp.items("events", namespace, f"--field-selector=reason={reason}")


def cpu_example(replicas: int) -> dict[str, Any]:
    doc = load("mstardeployment-cpu.yaml")
    doc["spec"]["replicas"] = replicas
    return doc


def test_the_control_plane_is_real(control_plane: ControlPlane) -> None:
    """kube-apiserver v1.37.2 (version ldflags: helm checks the chart's kubeVersion against it),
    two kwok nodes, the GPU one advertising nvidia.com/gpu; the chart's release deployed."""
    assert control_plane.server_version() == "v1.37.2"
    nodes = {n["metadata"]["name"]: n for n in control_plane.items("nodes", "default")}
    assert sorted(nodes) == ["kwok-cpu-0", "kwok-gpu-0"]
    assert nodes["kwok-gpu-0"]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in nodes["kwok-cpu-0"]["status"]["allocatable"]
    release = json.loads(
        control_plane.helm("status", RELEASE, "-n", RELEASE_NAMESPACE, "-o", "json")
    )
    assert release["info"]["status"] == "deployed"
    crd = control_plane.kubectl_json("get", "crd", "mstardeployments.mstar.dev")
    assert any(
        c["type"] == "Established" and c["status"] == "True" for c in crd["status"]["conditions"]
    )


def test_the_charts_rbac_is_what_the_apiserver_enforces(control_plane: ControlPlane) -> None:
    """The operator's ServiceAccount may do what it needs and nothing more (the real authorizer).
    It reads a Secret only by the name a CR gives (``spec.apiKeySecret``), never lists them."""
    sa = f"system:serviceaccount:{RELEASE_NAMESPACE}:{RELEASE}-operator"

    def can(*args: str) -> bool:
        proc = control_plane.kubectl("auth", "can-i", *args, f"--as={sa}", check=False)
        return proc.stdout.strip() == "yes"

    for allowed in [
        ("patch", "mstardeployments.mstar.dev/status", "-A"),
        ("create", "deployments.apps", "-n", "default"),
        ("delete", "horizontalpodautoscalers.autoscaling", "-n", "default"),
        ("create", "events", "-n", "default"),
        ("bind", "clusterroles.rbac.authorization.k8s.io/mstar-epp"),
        # a Secret named by a CR's spec.apiKeySecret: the adapter sync sends the engines' key
        ("get", "secrets", "-n", "default"),
    ]:
        assert can(*allowed), allowed
    for denied in [
        ("list", "secrets", "-n", "default"),  # by name only: never enumerated
        ("watch", "secrets", "-n", "default"),
        ("delete", "pods", "-n", "default"),
        ("create", "pods/eviction", "-n", "default"),
        ("update", "mstardeployments.mstar.dev", "-n", "default"),
        ("bind", "clusterroles.rbac.authorization.k8s.io/cluster-admin"),
        ("create", "clusterrolebindings.rbac.authorization.k8s.io"),
    ]:
        assert not can(*denied), denied


def test_gpu_example_is_ready_on_the_gpu_node(control_plane: ControlPlane) -> None:
    """examples/mstardeployment.yaml after the walkthrough's prerequisites: the real scheduler
    places its GPU pods on the GPU node (toleration, node selector, nvidia.com/gpu), the real
    Deployment controller brings them up, the HPA finds its selector, the printer columns show."""
    cp = control_plane
    cp.kubectl("apply", "-f", str(EXAMPLES / "mstardeployment.yaml"))
    cr = wait_ready(cp, "smollm2", "default", 2)
    status = cr["status"]
    assert status["observedGeneration"] == cr["metadata"]["generation"] == 1
    assert status["endpoint"] == "http://smollm2.default.svc:8000"
    assert status["selector"] == manifests.selector_string("smollm2")
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
    }
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])
    engine_pods = pods(cp, "smollm2", "default")
    assert len(engine_pods) == 2
    assert {p["spec"]["nodeName"] for p in engine_pods} == {"kwok-gpu-0"}
    assert all(p["spec"]["priority"] == 100000 for p in engine_pods)  # the PriorityClass admitted
    assert all(p["status"]["podIP"].startswith("127.1.0.") for p in engine_pods)
    claim = cp.get("pvc", "models", "default")
    assert claim is not None and claim["status"]["phase"] == "Bound"

    printed = cp.kubectl("get", "msd", "smollm2", "-n", "default").stdout.split("\n")
    assert printed[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "ENDPOINT", "AGE"]
    assert printed[1].split()[:5] == [
        "smollm2",
        "smollm2-135m-instruct",
        "2",
        "2",
        "http://smollm2.default.svc:8000",
    ]
    uid = cr["metadata"]["uid"]
    children = cp.items(CHILD_KINDS, "default", "-l", MANAGED)
    kinds = sorted(o["kind"] for o in children if o["kind"] not in ("ReplicaSet", "Pod"))
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
    ]
    for child in children:
        if child["kind"] in ("ReplicaSet", "Pod"):
            continue
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == ("MStarDeployment", uid, True)

    # The HPA reads the CR's scale subresource: it must have found the selector before the
    # first status update (else `SelectorRequired`), and it sees the 2 replicas through it.
    hpa = wait_for(
        lambda: (
            (h := cp.get("hpa", "smollm2", "default"))
            and (h.get("status") or {}).get("currentReplicas") == 2
            and h
        ),
        "the HPA to read the scale subresource",
        WAIT,
    )
    reasons = {
        e["reason"]
        for e in cp.items(
            "events", "default", "--field-selector=involvedObject.kind=HorizontalPodAutoscaler"
        )
    }
    assert "SelectorRequired" not in reasons
    assert not any(
        c.get("reason") == "SelectorRequired" for c in hpa["status"].get("conditions") or []
    )


def watch_events(stream: str) -> list[dict[str, Any]]:
    """The objects of a `kubectl get --watch --output-watch-events -o json` stream, in order."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while (at := stream.find("{", at)) >= 0:
        event, at = decoder.raw_decode(stream, at)
        out.append(event)
    return out


def test_status_selector_is_written_before_the_hpa_exists(
    control_plane: ControlPlane, namespace: str
) -> None:
    """The HPA reads the selector through the scale subresource; created before status.selector
    it answers `SelectorRequired` (how soon it looks is the HPA controller's timing, so the
    order is checked: resourceVersions are etcd revisions, one sequence for all objects)."""
    watchers = [
        subprocess.Popen(
            [
                "kubectl",
                f"--kubeconfig={control_plane.kubeconfig}",
                "get",
                kind,
                "-n",
                namespace,
                "--watch",
                "--output-watch-events",
                "-o",
                "json",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for kind in ("msd", "hpa")
    ]
    time.sleep(1)  # both watches established before anything exists
    doc = cpu_example(2)
    doc["spec"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 4}
    apply(control_plane, doc, namespace)
    wait_for(lambda: control_plane.get("hpa", "smollm2-cpu", namespace), "the HPA", WAIT)
    time.sleep(1)
    streams = []
    for watcher in watchers:
        watcher.terminate()
        streams.append(watcher.communicate(timeout=10)[0])
    with_selector = [
        int(e["object"]["metadata"]["resourceVersion"])
        for e in watch_events(streams[0])
        if (e["object"].get("status") or {}).get("selector")
    ]
    (hpa_added,) = [
        int(e["object"]["metadata"]["resourceVersion"])
        for e in watch_events(streams[1])
        if e["type"] == "ADDED"
    ]
    assert with_selector and min(with_selector) < hpa_added


def test_missing_priority_class_is_reported_as_degraded(
    control_plane: ControlPlane, namespace: str
) -> None:
    """A pod the apiserver refuses (no such PriorityClass) shows on the CR, not only in events."""
    doc = cpu_example(1)
    doc["spec"]["scheduling"] = {"priorityClassName": "no-such-class"}
    apply(control_plane, doc, namespace)
    cr = wait_condition(
        control_plane, "smollm2-cpu", namespace, "Degraded", reason="ReplicaFailure"
    )
    assert (
        "no PriorityClass with name no-such-class was found" in condition(cr, "Degraded")["message"]
    )
    assert condition(cr, "Ready")["status"] == "False"


def test_kubectl_scale_rollout_and_disruption_budget(
    control_plane: ControlPlane, namespace: str
) -> None:
    """`kubectl scale msd` goes through the scale subresource and the operator follows it; a
    spec change rolls out with maxUnavailable 0 (the real Deployment controller never drops
    below the desired ready pods); the real eviction API answers 429 where the PDB says so."""
    cp = control_plane
    apply(cp, cpu_example(1), namespace)
    wait_ready(cp, "smollm2-cpu", namespace, 1)
    assert cp.get("pdb", "smollm2-cpu", namespace) is None  # one replica: no budget

    cp.kubectl("scale", "msd", "smollm2-cpu", "-n", namespace, "--replicas=2")
    cr = wait_ready(cp, "smollm2-cpu", namespace, 2)
    assert cr["spec"]["replicas"] == 2
    deployment = cp.get("deployment", "smollm2-cpu", namespace)
    assert deployment is not None and deployment["spec"]["replicas"] == 2
    wait_for(
        lambda: (
            (p := cp.get("pdb", "smollm2-cpu", namespace))
            and (p.get("status") or {}).get("disruptionsAllowed") == 1
        ),
        "the PDB to allow one disruption",
        WAIT,
    )

    # Rollout: a new engine setting -> a new ReplicaSet; sample while it rolls.
    cp.kubectl(
        "patch", "msd", "smollm2-cpu", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"engine": {"maxNumSeqs": 32}}}),
    )  # fmt: skip
    least_ready, surge_seen = 2, False
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        current = pods(cp, "smollm2-cpu", namespace)
        least_ready = min(least_ready, sum(is_ready(p) for p in current))
        surge_seen |= len([p for p in current if not p["metadata"].get("deletionTimestamp")]) > 2
        if rollout_complete(cp.get("msd", "smollm2-cpu", namespace)):
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the rollout did not complete")
    assert least_ready >= 2, "a rollout with maxUnavailable 0 dropped a ready pod"
    assert surge_seen, "the new pod never surged above the desired count"
    replica_sets = cp.items(
        "replicasets", namespace, "-l", manifests.selector_string("smollm2-cpu")
    )
    assert sorted(rs["spec"]["replicas"] for rs in replica_sets) == [0, 2]
    serving = [p for p in pods(cp, "smollm2-cpu", namespace) if is_ready(p)]
    assert len(serving) == 2
    for pod in serving:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--max-num-seqs") + 1] == "32"

    # Disruptions: one eviction is allowed; while its replacement is not Ready, a second is 429.
    wait_for(
        lambda: (
            (p := cp.get("pdb", "smollm2-cpu", namespace))
            and p["status"].get("disruptionsAllowed") == 1
            and p["status"].get("currentHealthy") == 2
        ),
        "the PDB to see 2 healthy pods",
        WAIT,
    )
    first, second = sorted(
        p["metadata"]["name"] for p in pods(cp, "smollm2-cpu", namespace) if is_ready(p)
    )
    assert evict(cp, namespace, first) == 201
    # The replacement is Running but not Ready (kwok's stage, like an engine loading its model):
    # the budget has no room, and the real eviction API says so.
    replacement = wait_for(
        lambda: [
            p
            for p in pods(cp, "smollm2-cpu", namespace)
            if p["metadata"]["name"] not in (first, second) and not is_ready(p)
        ],
        "a not-yet-Ready replacement pod",
        WAIT,
    )
    assert evict(cp, namespace, second) == 429
    assert not is_ready(cp.get("pod", replacement[0]["metadata"]["name"], namespace) or {})
    wait_ready(cp, "smollm2-cpu", namespace, 2)
    wait_for(
        lambda: (
            (p := cp.get("pdb", "smollm2-cpu", namespace))
            and p["status"].get("disruptionsAllowed") == 1
        ),
        "the PDB to allow a disruption again",
        WAIT,
    )
    assert evict(cp, namespace, second) == 201

    # What an HPA reads through the scale subresource, then scaling to zero and a bad value.
    path = f"/apis/mstar.dev/v1alpha1/namespaces/{namespace}/mstardeployments/smollm2-cpu/scale"
    scale = json.loads(cp.kubectl("get", "--raw", path).stdout)
    assert (scale["kind"], scale["spec"]["replicas"]) == ("Scale", 2)
    assert scale["status"]["selector"] == manifests.selector_string("smollm2-cpu")
    cp.kubectl("scale", "msd", "smollm2-cpu", "-n", namespace, "--replicas=0")
    wait_for(
        lambda: (
            pods(cp, "smollm2-cpu", namespace) == []
            and cp.get("pdb", "smollm2-cpu", namespace) is None
        ),
        "the pods and the PDB to go at 0 replicas",
        WAIT,
    )
    bad = cp.kubectl("scale", "msd", "smollm2-cpu", "-n", namespace, "--replicas=-1", check=False)
    assert bad.returncode != 0


def evict(cp: ControlPlane, namespace: str, pod: str) -> int:
    """POST an Eviction through the real eviction subresource; the HTTP status it answered."""
    body = json.dumps(
        {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": pod, "namespace": namespace},
        }
    )
    proc = cp.kubectl(
        "create", "--raw", f"/api/v1/namespaces/{namespace}/pods/{pod}/eviction", "-f", "-",
        check=False, stdin=body,
    )  # fmt: skip
    if proc.returncode == 0:
        return 201
    if "TooManyRequests" in proc.stderr or "disruption budget" in proc.stderr:
        return 429
    raise AssertionError(f"eviction of {pod} failed unexpectedly: {proc.stderr}")


CEL_CASES = {
    "min-above-max": (
        {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}},
        "minReplicas exceeds maxReplicas",
    ),
    "hpa-to-zero": ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, "needs mode keda"),
    "quiet-above-timeout": (
        {"drain": {"quietSeconds": 60, "preStopTimeoutSeconds": 30}},
        "quietSeconds exceeds preStopTimeoutSeconds",
    ),
    "len-above-capacity": (
        {"engine": {"numPages": 64, "pageSize": 16, "maxModelLen": 8192}},
        "maxModelLen exceeds the KV capacity",
    ),
}


def test_invalid_crs_are_rejected_by_the_apiserver(
    control_plane: ControlPlane, namespace: str
) -> None:
    """The structural schema and the CEL rules refuse bad specs at `kubectl apply`; what only
    the operator can judge (quantities) becomes Degraded=InvalidSpec, and nothing is deployed."""
    for doc in yaml.safe_load_all((CRS / "invalid-schema.yaml").read_text()):
        proc = control_plane.kubectl(
            "apply", "-n", namespace, "-f", "-", check=False, stdin=json.dumps(doc)
        )
        assert proc.returncode != 0, f"{doc['metadata']['name']} was accepted"
        assert f'MStarDeployment "{doc["metadata"]["name"]}" is invalid' in proc.stderr, proc.stderr
    for name, (patch, message) in CEL_CASES.items():
        doc = cpu_example(1)
        doc["metadata"]["name"] = name
        for key, value in patch.items():
            doc["spec"][key] = {**doc["spec"].get(key, {}), **value}
        proc = control_plane.kubectl(
            "apply", "-n", namespace, "-f", "-", check=False, stdin=json.dumps(doc)
        )
        assert proc.returncode != 0 and message in proc.stderr, (name, proc.stderr)
    assert control_plane.items("msd", namespace) == []

    control_plane.kubectl("apply", "-n", namespace, "-f", str(CRS / "invalid-semantic.yaml"))
    cr = wait_condition(control_plane, "broken", namespace, "Degraded", reason="InvalidSpec")
    assert "hostOffloadGiB (8 GiB) does not fit" in condition(cr, "Degraded")["message"]
    assert events(control_plane, namespace, "InvalidSpec")
    assert managed(control_plane, namespace) == []


def test_deleting_the_cr_lets_the_garbage_collector_remove_every_child(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    doc = cpu_example(2)
    doc["spec"]["autoscaling"] = {"minReplicas": 2, "maxReplicas": 4}
    apply(cp, doc, namespace)
    wait_ready(cp, "smollm2-cpu", namespace, 2)
    before = managed(cp, namespace)
    assert {k.split("/")[0] for k in before} >= {
        "Deployment", "ReplicaSet", "Pod", "Service", "ConfigMap", "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
    }  # fmt: skip
    cp.kubectl("delete", "msd", "smollm2-cpu", "-n", namespace, "--wait=false")
    wait_for(
        lambda: managed(cp, namespace) == [], "the garbage collector to remove every child", WAIT
    )


def test_drift_is_corrected(control_plane: ControlPlane, namespace: str) -> None:
    cp = control_plane
    apply(cp, cpu_example(1), namespace)
    wait_ready(cp, "smollm2-cpu", namespace, 1)
    service = cp.get("service", "smollm2-cpu", namespace)
    assert service is not None
    image = "/spec/template/spec/containers/0/image"
    edit = [{"op": "replace", "path": image, "value": "evil:1"}]
    cp.kubectl(
        "patch", "deployment", "smollm2-cpu", "-n", namespace, "--type=json", "-p", json.dumps(edit)
    )
    cp.kubectl("delete", "service", "smollm2-cpu", "-n", namespace)

    def restored() -> bool:
        dep = cp.get("deployment", "smollm2-cpu", namespace)
        svc = cp.get("service", "smollm2-cpu", namespace)
        image = dep["spec"]["template"]["spec"]["containers"][0]["image"] if dep else None
        return image == "ghcr.io/mstar-project/mstar-engine:0.1.0" and svc is not None

    wait_for(restored, "the image edit reverted and the Service recreated", WAIT)
    svc = cp.get("service", "smollm2-cpu", namespace)
    assert svc is not None and svc["metadata"]["uid"] != service["metadata"]["uid"]
    assert events(cp, namespace, "DriftCorrected")
    wait_ready(cp, "smollm2-cpu", namespace, 1)


def _snapshot(cp: ControlPlane, namespace: str) -> dict[str, tuple[str, str]]:
    return {
        f"{o['kind']}/{o['metadata']['name']}": (
            o["metadata"]["uid"],
            o["metadata"]["resourceVersion"],
        )
        for o in cp.items(
            "deployments,services,configmaps,poddisruptionbudgets,replicasets",
            namespace,
            "-l",
            MANAGED,
        )
    }


def test_operator_restart_duplicates_and_recreates_nothing(
    control_plane: ControlPlane, namespace: str, real_operator: Operator
) -> None:
    cp = control_plane
    apply(cp, cpu_example(2), namespace)
    wait_ready(cp, "smollm2-cpu", namespace, 2)
    before = _snapshot(cp, namespace)
    real_operator.stop()
    real_operator.start()
    # Kopf resumes every CR after a restart; wait until this one's pass has run.
    log = real_operator.logdir / f"operator-{real_operator.starts}.log"
    wait_for(
        lambda: f"[{namespace}/smollm2-cpu] Resuming is processed" in log.read_text(),
        "the restarted operator to resume the CR",
        WAIT,
    )
    time.sleep(3)  # and a quiet spell after it: nothing may be created, replaced or patched
    assert _snapshot(cp, namespace) == before


def test_apiserver_restart_mid_reconcile_is_survived(
    control_plane: ControlPlane, namespace: str, real_operator: Operator
) -> None:
    cp = control_plane
    apply(cp, cpu_example(2), namespace)
    cp.restart_apiserver()  # while the operator creates the children
    assert real_operator.healthy()
    wait_ready(cp, "smollm2-cpu", namespace, 2)
    # The watches came back: a change after the restart is reconciled too.
    cp.kubectl("scale", "msd", "smollm2-cpu", "-n", namespace, "--replicas=1")
    wait_ready(cp, "smollm2-cpu", namespace, 1)
    kinds = sorted(k.split("/")[0] for k in _snapshot(cp, namespace))
    assert kinds.count("Deployment") == 1 and kinds.count("Service") == 1


def test_operator_never_fights_the_hpa(control_plane: ControlPlane, namespace: str) -> None:
    """The HPA (and kubectl scale) write spec.replicas through the scale subresource; the
    operator carries it to the Deployment and never writes it back."""
    cp = control_plane
    doc = cpu_example(2)
    doc["spec"]["autoscaling"] = {"minReplicas": 3, "maxReplicas": 5}
    apply(cp, doc, namespace)
    # The real HPA controller enforces minReplicas 3 through the scale subresource.
    cr = wait_ready(cp, "smollm2-cpu", namespace, 3)
    assert cr["spec"]["replicas"] == 3
    rescaled = wait_for(
        lambda: [
            e["message"]
            for e in events(cp, namespace, "SuccessfulRescale")
            if e["involvedObject"]["kind"] == "HorizontalPodAutoscaler"
        ],
        "the HPA's rescale event",
    )
    assert any("New size: 3" in m and "below Spec.MinReplicas" in m for m in rescaled), rescaled
    time.sleep(6)  # more than an HPA sync period: replicas stay where the HPA put them
    cr = cp.get("msd", "smollm2-cpu", namespace)
    assert cr is not None and cr["spec"]["replicas"] == 3
    dep = cp.get("deployment", "smollm2-cpu", namespace)
    assert dep is not None and dep["spec"]["replicas"] == 3


MISSING_API = "does not serve inference.networking.k8s.io/v1"


def test_routing_without_its_crds_is_reported_once_then_heals(
    control_plane: ControlPlane, namespace: str, real_operator: Operator
) -> None:
    """spec.router on a cluster without the InferencePool/Gateway CRDs: Degraded with the reason,
    no retry loop (no ERROR line every 5 s); once the CRDs are installed the resync creates
    the pool, the route and the picker, and the routed example reaches Ready."""
    cp = control_plane
    assert cp.get("crd", "inferencepools.inference.networking.k8s.io", "default") is None, (
        "this test needs a cluster without the InferencePool CRD"
    )
    apply(cp, load("mstardeployment-routed.yaml"), namespace)
    cr = wait_condition(cp, "smollm2-routed", namespace, "Degraded", message=MISSING_API)
    assert condition(cr, "Degraded")["status"] == "True"
    assert cp.get("deployment", "smollm2-routed", namespace) is not None  # serving goes on
    mark = len(real_operator.log())
    time.sleep(12)
    about_it = [
        line for line in real_operator.log()[mark:].splitlines() if f"[{namespace}/" in line
    ]
    assert not [line for line in about_it if "failed temporarily" in line or "ERROR" in line]

    crds = subprocess.run(
        ["bash", str(ROOT / "scripts" / "cluster.sh"), "crds"],
        capture_output=True, text=True, check=True, timeout=600,
    ).stdout.strip()  # fmt: skip
    cp.kubectl("apply", "--server-side", "-f", crds)
    cp.kubectl(
        "wait",
        "--for=condition=Established",
        "crd/inferencepools.inference.networking.k8s.io",
        "crd/httproutes.gateway.networking.k8s.io",
    )
    # The resync (every 20 s here) creates what was missing; nothing else changed.
    cr = wait_condition(cp, "smollm2-routed", namespace, "Degraded", status="False")
    wait_ready(cp, "smollm2-routed", namespace, 2)
    epp = router.epp_name("smollm2-routed")
    routing = [
        ("inferencepools.inference.networking.k8s.io", "smollm2-routed"),
        ("httproutes.gateway.networking.k8s.io", "smollm2-routed"),
        ("deployment", epp),
        ("service", epp),
        ("configmap", epp),
        ("serviceaccount", epp),
        ("rolebinding", epp),
    ]
    for kind, name in routing:
        obj = cp.get(kind, name, namespace)
        assert obj is not None, (kind, name)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == cr["metadata"]["uid"]
    selector = ",".join(f"{k}={v}" for k, v in router.epp_labels("smollm2-routed").items())
    picker = wait_for(
        lambda: [p for p in cp.items("pods", namespace, "-l", selector) if is_ready(p)],
        "the picker pod",
        WAIT,
    )
    assert picker[0]["spec"]["serviceAccountName"] == epp

    # Routing leaves the spec: the operator deletes exactly those children, serving goes on.
    cp.kubectl("patch", "msd", "smollm2-routed", "-n", namespace, "--type=json",
               "-p", json.dumps([{"op": "remove", "path": "/spec/router"}]))  # fmt: skip
    wait_for(
        lambda: all(cp.get(kind, name, namespace) is None for kind, name in routing[:4]),
        "the routing children to go when spec.router is removed",
        WAIT,
    )
    assert cp.get("deployment", "smollm2-routed", namespace) is not None
