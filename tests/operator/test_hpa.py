"""Autoscaling that acts: the real HPA controller (kube-controller-manager v1.37.2) scaling an
MStarDeployment on `mstar_num_requests_waiting`, served by prometheus-adapter v0.12.0 with the
chart's rule, from Debian's Prometheus scraping real `mstar-engine serve` processes on their
kwok pod addresses. The desired replicas rise with the waiting queue and fall once it drains.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from built_tools import Process, module_version, tool_bin, wait_until
from epp_harness import Engine
from external_tools import require_tool
from hpa_harness import (
    NetNamespace,
    Prometheus,
    TcpRelay,
    adapter_kubeconfig,
    apiserver_port,
    custom_metric,
    register_api_service,
    start_adapter,
)
from live_server import BackgroundLoad
from real_cluster import ControlPlane
from test_cluster import WAIT, apply, load, pods

NAME, NAMESPACE = "scaled", "hpa"
METRIC = "mstar_num_requests_waiting"  # the HPA's metric, the chart's adapter rule's name
pytestmark = pytest.mark.usefixtures("real_operator")


@dataclass
class Stack:
    cp: ControlPlane
    model_dir: Path
    logs: Path
    prometheus: Prometheus | None = None
    processes: list[Process] = field(default_factory=list)
    engines: dict[str, Engine] = field(default_factory=dict)

    def sync_engines(self) -> None:
        """A real engine for every engine pod with an address; none for pods that are gone;
        Prometheus's targets follow."""
        found = pods(self.cp, NAME, NAMESPACE)
        assert self.prometheus is not None
        self.prometheus.discover(found)
        live = {p["metadata"]["name"]: p for p in found}
        for name, pod in live.items():
            if name not in self.engines and pod.get("status", {}).get("podIP"):
                self.engines[name] = Engine(pod, self.model_dir, self.logs)
        for name in [n for n in self.engines if n not in live]:
            self.engines.pop(name).stop()

    def hpa(self) -> dict[str, Any]:
        return self.cp.kubectl_json("get", "hpa", NAME, "-n", NAMESPACE)


def scaled_cr() -> dict[str, Any]:
    doc = load("mstardeployment-routed.yaml")
    doc["metadata"]["name"] = NAME
    spec = doc["spec"]
    del spec["router"]
    spec["replicas"] = 1
    spec["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, "targetWaitingRequestsPerReplica": 4}
    spec["engine"] = {"numPages": 256, "pageSize": 4, "maxNumSeqs": 2, "hostOffloadGiB": 0}
    return doc


@pytest.fixture(scope="module")
def stack(
    control_plane: ControlPlane, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    for tool in ("prometheus", "ip"):
        require_tool(tool)
    cp = control_plane
    adapter_bin = tool_bin("adapter") / "adapter"
    print(f"\nprometheus-adapter {module_version(adapter_bin, 'sigs.k8s.io/prometheus-adapter')}, "
          f"kube-controller-manager {cp.server_version()} (HPA controller)")  # fmt: skip
    logs = tmp_path_factory.mktemp("hpa")
    stack = Stack(cp, tiny_llama_dir, logs)
    netns = NetNamespace()
    port = apiserver_port(cp)
    relay = TcpRelay(netns.host_ip, port)
    cp.kubectl("create", "namespace", NAMESPACE)
    try:
        stack.prometheus = Prometheus(netns.host_ip, logs)
        stack.processes.append(stack.prometheus)
        kubeconfig = adapter_kubeconfig(cp, f"https://{netns.host_ip}:{port}", logs / "adapter.kc")
        adapter = start_adapter(netns, kubeconfig, stack.prometheus.url, logs)
        stack.processes.append(adapter)
        register_api_service(cp, netns, NAMESPACE)
        apply(cp, scaled_cr(), NAMESPACE)
        wait_until(lambda: stack.sync_engines() or len(stack.engines) == 1, "one engine pod", WAIT)
        (engine,) = stack.engines.values()
        wait_until(engine.ready, f"engine {engine.name}", WAIT, engine)
        yield stack
    finally:
        for e in stack.engines.values():
            e.stop()
        for p in reversed(stack.processes):
            p.stop()
        relay.close()
        netns.close()
        cp.kubectl("delete", "apiservice", "v1beta2.custom.metrics.k8s.io", check=False)
        cp.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_the_hpa_scales_up_with_the_queue_and_down_after_it_drains(stack: Stack) -> None:
    cp = stack.cp
    # The adapter answers for the engine pod from Prometheus's scrapes: nothing waits yet.
    values = wait_until(lambda: custom_metric(cp, NAMESPACE, METRIC), "the custom metric", WAIT)
    assert list(values.values()) == [0.0]
    # The HPA reads it (its first status may come before its first recommendation).
    wait_until(
        lambda: (s := stack.hpa().get("status", {})).get("currentMetrics")
        and s.get("desiredReplicas") == 1,
        "the HPA to read the metric and want 1 replica", WAIT,
    )  # fmt: skip

    (engine,) = stack.engines.values()
    body = {"prompt": "w7 w8 w9", "max_tokens": 150, "ignore_eos": True}
    timeline: list[tuple[float, float, int]] = []
    t0 = time.monotonic()

    def observe() -> int:
        stack.sync_engines()
        waiting = sum(custom_metric(cp, NAMESPACE, METRIC).values())
        desired = int(stack.hpa().get("status", {}).get("desiredReplicas", 0))
        if not timeline or timeline[-1][1:] != (waiting, desired):
            timeline.append((time.monotonic() - t0, waiting, desired))
        return desired

    with BackgroundLoad(engine.url, 12, lambda _: body):  # 2 running, ~10 waiting
        wait_until(lambda: observe() == 3, "the HPA to want 3 replicas", WAIT)
        cr = wait_until(
            lambda: (c := cp.get("msd", NAME, NAMESPACE)) and c["spec"]["replicas"] == 3 and c,
            "the MStarDeployment scaled to 3", WAIT,
        )  # fmt: skip
        assert cr["spec"]["replicas"] == 3
        wait_until(lambda: observe() and len(stack.engines) == 3, "engines for new pods", WAIT)
    wait_until(lambda: observe() == 1, "the HPA to want 1 replica again", 2 * WAIT)
    print("\nseconds | waiting (custom.metrics.k8s.io) | HPA desired replicas")
    for at, waiting, desired in timeline:
        print(f"{at:7.1f} | {waiting:5.0f} | {desired}")
    assert max(w for _, w, _ in timeline) >= 8
    desired = [d for _, _, d in timeline]
    assert desired[0] == 1 and max(desired) == 3 and desired[-1] == 1
