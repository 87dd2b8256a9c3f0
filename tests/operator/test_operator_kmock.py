"""The real operator (Kopf, own process) against the KMock cluster emulator, driven by kubectl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kube_emulator import EmulatedCluster
from op_harness import CRS, EXAMPLE, ROOT, Kubectl, Operator, operator_calls, wait_for

from mstar.engine.config import parse_cli_args
from mstar.operator.manifests import CONFIG_HASH_ANNOTATION
from mstar.operator.spec import engine_config, parse_spec

NS = "default"
NAME = "smollm2"
CHILDREN = {
    "apps/v1/deployments": NAME,
    "v1/services": NAME,
    "v1/configmaps": f"{NAME}-engine",
    "autoscaling/v2/horizontalpodautoscalers": NAME,
    "policy/v1/poddisruptionbudgets": NAME,  # replicas: 2
}


def cr(cluster: EmulatedCluster, name: str = NAME) -> dict[str, Any] | None:
    return cluster.get("mstar.dev/v1alpha1/mstardeployments", NS, name)


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def children(cluster: EmulatedCluster) -> dict[str, dict[str, Any] | None]:
    return {res: cluster.get(res, NS, name) for res, name in CHILDREN.items()}


def all_children(cluster: EmulatedCluster) -> dict[str, dict[str, Any]]:
    return wait_for(lambda: (c := children(cluster)) and all(c.values()) and c, "all children")


def events(cluster: EmulatedCluster, uid: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in cluster.objects("v1/events", NS)
        if e.get("involvedObject", {}).get("uid") == uid and e.get("reason") == reason
    ]


def managed(cluster: EmulatedCluster) -> list[tuple[str, str]]:
    out = []
    for res in CHILDREN:
        for obj in cluster.objects(res):
            labels = obj["metadata"].get("labels") or {}
            if labels.get("app.kubernetes.io/managed-by") == "mstar-operator":
                out.append((res, obj["metadata"]["name"]))
    return sorted(out)


def engine_container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(container)


def test_apply_creates_owned_children(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator
) -> None:
    kubectl.apply(EXAMPLE)
    found = all_children(cluster)
    owner = cr(cluster)
    assert owner is not None
    uid = owner["metadata"]["uid"]
    for obj in found.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {
            "apiVersion": "mstar.dev/v1alpha1",
            "kind": "MStarDeployment",
            "name": NAME,
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }

    deployment = found["apps/v1/deployments"]
    assert deployment is not None
    pod = deployment["spec"]["template"]
    engine = engine_container(deployment)
    assert deployment["spec"]["replicas"] == 2
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert engine["resources"]["limits"]["memory"] == "24Gi"
    assert engine["command"] == ["mstar-engine", "serve"]
    # The flag contract: what the container gets parses back to the spec's EngineConfig.
    parsed = parse_cli_args(engine["args"])
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    assert parsed == engine_config(parse_spec(spec))
    assert parsed.gpu_memory_utilization == 0.85
    assert parsed.max_model_len == 8192
    assert parsed.host_offload_gb == 8.0
    assert parsed.model == "/models/SmolLM2-135M-Instruct"
    assert parsed.served_model_name == "smollm2-135m-instruct"
    assert (parsed.device, parsed.host, parsed.port) == ("cuda", "0.0.0.0", 8000)
    assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert engine["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger-collector.observability.svc:4318"
    assert env["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio"
    assert env["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    assert "mstar.deployment=smollm2" in env["OTEL_RESOURCE_ATTRIBUTES"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert annotations["prometheus.io/path"] == "/metrics"
    assert engine["securityContext"]["readOnlyRootFilesystem"] is True
    assert engine["securityContext"]["runAsNonRoot"] is True
    assert pod["spec"]["securityContext"]["runAsUser"] == 1000
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["spec"]["priorityClassName"] == "inference"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    # Safe rollouts and scale-down: a new pod is Ready before an old one goes; a terminating pod
    # first waits (preStop) until no request arrives, then drains within the grace period.
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert engine["lifecycle"]["preStop"]["exec"]["command"][:2] == ["mstar-engine", "prestop"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 30 + 30 + 10  # preStop + drain + margin
    budget = found["policy/v1/poddisruptionbudgets"]
    assert budget is not None and budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"] == deployment["spec"]["selector"]
    assert "--max-num-seqs" in engine["args"]  # a default, rendered explicitly

    service = found["v1/services"]
    assert service is not None
    assert service["spec"]["ports"][0]["port"] == 8000
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    hpa = found["autoscaling/v2/horizontalpodautoscalers"]
    assert hpa is not None
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "mstar.dev/v1alpha1",
        "kind": "MStarDeployment",
        "name": NAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "4"
    config_map = found["v1/configmaps"]
    assert config_map is not None
    assert "engine-config.json" in config_map["data"]

    status = wait_for(lambda: (c := cr(cluster)) and c.get("status"), "status")
    assert status["observedGeneration"] == 1
    assert status["endpoint"] == "http://smollm2.default.svc:8000"
    assert condition(cr(cluster), "Ready")["status"] == "False"
    assert condition(cr(cluster), "Progressing")["status"] == "True"
    assert condition(cr(cluster), "Degraded")["reason"] == "AsExpected"
    wait_for(lambda: events(cluster, uid, "Created"), "Created events")

    # Play the Deployment controller: both replicas become ready -> the CR reports Ready.
    generation = deployment["metadata"]["generation"]
    kubectl.patch(
        "deployment",
        NAME,
        patch={
            "status": {
                "observedGeneration": generation,
                "replicas": 2,
                "readyReplicas": 2,
                "updatedReplicas": 2,
            }
        },
        subresource="status",
    )
    ready = wait_for(
        lambda: condition(cr(cluster), "Ready").get("status") == "True" and cr(cluster), "Ready"
    )
    assert ready["status"]["readyReplicas"] == 2
    assert condition(ready, "Progressing")["reason"] == "RolloutComplete"
    wait_for(lambda: events(cluster, uid, "Ready"), "a Ready event")
    printed = kubectl.run("get", "msd", NAME, "-o", "wide").stdout
    assert NAME in printed


def test_spec_change_rolls_out(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator
) -> None:
    kubectl.apply(EXAMPLE)
    before = all_children(cluster)["apps/v1/deployments"]
    assert before is not None
    old_hash = before["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    kubectl.patch(
        "mstardeployment",
        NAME,
        patch={
            "spec": {
                "replicas": 3,
                "engine": {"maxNumSeqs": 32, "cudaGraphBatchSizes": [1, 2, 4, 8, 16, 32]},
                "autoscaling": None,
            }
        },
    )

    def rolled() -> dict[str, Any] | None:
        dep = cluster.get("apps/v1/deployments", NS, NAME)
        if dep and parse_cli_args(engine_container(dep)["args"]).max_num_seqs == 32:
            return dep
        return None

    dep = wait_for(rolled, "the Deployment to carry the new flags")
    parsed = parse_cli_args(engine_container(dep)["args"])
    assert parsed.cuda_graph_batch_sizes == [1, 2, 4, 8, 16, 32]
    assert dep["spec"]["replicas"] == 3
    assert dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != old_hash
    wait_for(
        lambda: cluster.get("autoscaling/v2/horizontalpodautoscalers", NS, NAME) is None,
        "the HPA to go when autoscaling is removed",
    )
    config_map = cluster.get("v1/configmaps", NS, f"{NAME}-engine")
    assert (
        config_map is not None and '"max_num_seqs": 32' in config_map["data"]["engine-config.json"]
    )
    wait_for(
        lambda: ((cr(cluster) or {}).get("status") or {}).get("observedGeneration") == 2,
        "observedGeneration 2",
    )
    uid = (cr(cluster) or {})["metadata"]["uid"]
    wait_for(lambda: events(cluster, uid, "Updated"), "an Updated event")


def test_drift_is_corrected(cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator) -> None:
    kubectl.apply(EXAMPLE)
    first = all_children(cluster)
    service_uid = (first["v1/services"] or {})["metadata"]["uid"]

    kubectl.run("delete", "service", NAME)
    back = wait_for(
        lambda: (
            (s := cluster.get("v1/services", NS, NAME))
            and s["metadata"]["uid"] != service_uid
            and s
        ),
        "the deleted Service to come back",
    )
    assert back["spec"]["ports"][0]["port"] == 8000

    dep = first["apps/v1/deployments"] or {}
    hand_edit = engine_container(dep) | {"args": ["--max-num-seqs", "1"], "image": "evil:latest"}
    kubectl.patch(
        "deployment",
        NAME,
        patch={"spec": {"replicas": 9, "template": {"spec": {"containers": [hand_edit]}}}},
    )
    kubectl.patch("configmap", f"{NAME}-engine", patch={"data": {"engine-args.json": "[]"}})

    def restored() -> bool:
        d = cluster.get("apps/v1/deployments", NS, NAME) or {}
        c = cluster.get("v1/configmaps", NS, f"{NAME}-engine") or {}
        return bool(
            d
            and d["spec"]["replicas"] == 2
            and engine_container(d)["args"] == engine_container(dep)["args"]
            and engine_container(d)["image"] == engine_container(dep)["image"]
            and c.get("data", {}).get("engine-args.json") != "[]"
        )

    wait_for(restored, "hand edits of the Deployment and ConfigMap to be undone")
    uid = (cr(cluster) or {})["metadata"]["uid"]
    wait_for(lambda: events(cluster, uid, "DriftCorrected"), "DriftCorrected events")


def test_restart_creates_no_duplicates(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator
) -> None:
    kubectl.apply(EXAMPLE)
    first = all_children(cluster)
    uids = {res: (obj or {})["metadata"]["uid"] for res, obj in first.items()}
    operator.stop()
    # A change while the operator is down is picked up when it comes back (resume).
    kubectl.patch("mstardeployment", NAME, patch={"spec": {"replicas": 4}})
    operator.start()
    wait_for(
        lambda: (cluster.get("apps/v1/deployments", NS, NAME) or {})["spec"]["replicas"] == 4,
        "the restarted operator to apply the change made while it was down",
    )
    wait_for(
        lambda: ((cr(cluster) or {}).get("status") or {}).get("observedGeneration") == 2,
        "status of generation 2",
    )
    assert managed(cluster) == sorted(CHILDREN.items())
    now = children(cluster)
    assert {res: (obj or {})["metadata"]["uid"] for res, obj in now.items()} == uids
    # A second restart with nothing to do changes nothing at all.
    versions = {res: (obj or {})["metadata"]["resourceVersion"] for res, obj in now.items()}
    operator.stop()
    operator.start()
    kubectl.patch("mstardeployment", NAME, patch={"metadata": {"labels": {"poke": "1"}}})
    wait_for(
        lambda: (
            (cr(cluster) or {})["metadata"]
            .get("annotations", {})
            .get("mstar.dev/last-handled-configuration", "")
            .find('"poke"')
            >= 0
        ),
        "the restarted operator to handle the CR",
    )
    assert managed(cluster) == sorted(CHILDREN.items())
    calls = operator_calls(cluster)  # what the RBAC check at teardown compares with the chart
    assert ("mstar.dev", "mstardeployments/status", "patch") in calls
    assert ("", "events", "create") in calls
    assert ("apps", "deployments", "watch") in calls
    again = children(cluster)
    assert {res: (obj or {})["metadata"]["resourceVersion"] for res, obj in again.items()} == (
        versions
    )


def test_invalid_spec_degrades_without_crashing(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator
) -> None:
    kubectl.apply(CRS / "invalid-semantic.yaml")
    broken = wait_for(
        lambda: (
            condition(cr(cluster, "broken"), "Degraded").get("status") == "True"
            and cr(cluster, "broken")
        ),
        "Degraded=True",
    )
    degraded = condition(broken, "Degraded")
    assert degraded["reason"] == "InvalidSpec"
    assert "maxModelLen (8192) exceeds the KV capacity" in degraded["message"]
    assert "minReplicas (5) exceeds maxReplicas (2)" in degraded["message"]
    uid = broken["metadata"]["uid"]
    (event,) = wait_for(lambda: events(cluster, uid, "InvalidSpec"), "an InvalidSpec event")
    assert event["type"] == "Warning"
    assert "maxModelLen" in event["message"]
    assert cluster.get("apps/v1/deployments", NS, "broken") is None
    assert operator.healthy()

    # Fixing the spec clears the condition and deploys.
    kubectl.patch(
        "mstardeployment",
        "broken",
        patch={"spec": {"engine": {"numPages": 1024}, "autoscaling": None}},
    )
    wait_for(
        lambda: condition(cr(cluster, "broken"), "Degraded").get("status") == "False",
        "Degraded=False after the fix",
    )
    wait_for(lambda: cluster.get("apps/v1/deployments", NS, "broken"), "the Deployment")


def test_deleting_the_cr_leaves_nothing(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator
) -> None:
    kubectl.apply(EXAMPLE)
    all_children(cluster)
    assert managed(cluster)
    kubectl.run("delete", "mstardeployment", NAME)
    wait_for(lambda: not managed(cluster), "every child to be garbage-collected")
    assert cr(cluster) is None
    # The operator saw the children go; it must not bring any back for a CR that is gone. As a
    # barrier, deploy another CR: once its children exist, the earlier deletions were handled.
    kubectl.apply(ROOT / "examples" / "mstardeployment-cpu.yaml")
    wait_for(lambda: cluster.get("apps/v1/deployments", NS, "smollm2-cpu"), "the barrier CR")
    wait_for(lambda: condition(cr(cluster, "smollm2-cpu"), "Ready").get("reason"), "barrier status")
    assert {name for _, name in managed(cluster)} == {"smollm2-cpu", "smollm2-cpu-engine"}
    assert operator.healthy()
    # Events are not owned: Kubernetes expires them by TTL (they name, not own, the CR).


def test_name_conflict_is_reported_and_heals(
    cluster: EmulatedCluster, kubectl: Kubectl, operator: Operator, tmp_path: Path
) -> None:
    operator.stop()
    operator.args = ["--resync-seconds", "1"]
    operator.start()
    squatter = tmp_path / "squatter.yaml"  # someone else's Service, under the name we need
    squatter.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": NAME, "namespace": NS},
                "spec": {"ports": [{"port": 80}], "selector": {"app": "other"}},
            }
        )
    )
    kubectl.apply(squatter)
    kubectl.apply(EXAMPLE)
    broken = wait_for(
        lambda: (
            condition(cr(cluster), "Degraded").get("reason") == "ReconcileFailed" and cr(cluster)
        ),
        "Degraded=ReconcileFailed",
    )
    message = condition(broken, "Degraded")["message"]
    assert "Service smollm2 already exists and is not controlled by this MStarDeployment" in message
    wait_for(lambda: cluster.get("apps/v1/deployments", NS, NAME), "the other children anyway")
    foreign = cluster.get("v1/services", NS, NAME) or {}
    assert "ownerReferences" not in foreign["metadata"]  # never stolen
    assert foreign["spec"]["ports"][0]["port"] == 80
    uid = broken["metadata"]["uid"]
    (warning,) = wait_for(lambda: events(cluster, uid, "ReconcileFailed"), "a Warning event")
    assert warning["type"] == "Warning"

    kubectl.run("delete", "service", NAME)  # unlabelled: only the periodic resync notices
    wait_for(
        lambda: (
            condition(cr(cluster), "Degraded").get("status") == "False"
            and ((cluster.get("v1/services", NS, NAME) or {}).get("metadata") or {}).get(
                "ownerReferences"
            )
        ),
        "the operator's own Service after the squatter left",
    )
    wait_for(lambda: events(cluster, uid, "Recovered"), "a Recovered event")
