"""The real endpoint picker around a routed MStarDeployment on the local control plane.

The operator renders the picker's Deployment and ConfigMap; kwok runs no containers, so the
tests run what those pods would run, as processes: the picker binary (`scripts/cluster.sh
build-tools epp`) with the Deployment's args and the ConfigMap's file, authenticated as the
picker's ServiceAccount, and one real `mstar-engine serve` per engine pod, listening on the
pod's kwok address (127.1.0.0/24). `Gateway` drives the picker's ext-proc stream as Envoy does
(tests/operator/extproc_gateway) and sends each request on to the engine it picked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from built_tools import Process, free_port
from prometheus_client.parser import text_string_to_metric_families
from real_cluster import ROOT

from mstar.operator.spec import ENGINE_PORT

EPP_VERSION = "v1.5.0"  # scripts/cluster.sh EPP_VERSION: the Inference Extension release


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def gauge(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    values = [v for (n, _), v in samples.items() if n == name]
    assert len(values) == 1, f"{name}: {values}"
    return values[0]


def _mounted(pod: dict[str, Any], config_maps: dict[str, dict[str, str]], root: Path) -> list[str]:
    """The container's args with each mounted ConfigMap's files written under ``root`` and
    every arg inside its mount path pointed there."""
    (container,) = pod["spec"]["containers"]
    volumes = {v["name"]: v for v in pod["spec"].get("volumes") or []}
    args = list(container["args"])
    for mount in container.get("volumeMounts") or []:
        source = volumes.get(mount["name"], {}).get("configMap")
        if source is None or source["name"] not in config_maps:
            continue
        local = root / mount["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, text in config_maps[source["name"]].items():
            (local / key).write_text(text)
        prefix = mount["mountPath"].rstrip("/") + "/"
        args = [str(local / a[len(prefix) :]) if a.startswith(prefix) else a for a in args]
    return args


class Engine(Process):
    """`mstar-engine serve` with an engine pod's container args, on the pod's address."""

    def __init__(
        self,
        pod: dict[str, Any],
        model_dir: Path,
        logs: Path,
        config_maps: dict[str, dict[str, str]] | None = None,
    ) -> None:
        """``config_maps``: {name: data} of the ConfigMaps the pod mounts, written under
        ``logs`` and named by their local path in the args (the kubelet's mount)."""
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["mstar-engine", "serve"], container["command"]
        self.name = pod["metadata"]["name"]
        self.ip = pod["status"]["podIP"]
        assert self.ip.startswith("127."), f"{self.name}: a pod address outside loopback"
        self.url = f"http://{self.ip}:{ENGINE_PORT}"
        # The pod's args, then what differs here: a tiny model on this machine's CPU, the
        # pod's own address. argparse keeps the last of a repeated flag.
        args = _mounted(pod, config_maps or {}, logs / f"{self.name}-volumes")
        argv = [sys.executable, "-m", "mstar.engine.cli", "serve", *args]
        argv += [str(model_dir), "--host", self.ip, "--port", str(ENGINE_PORT)]
        argv += ["--dtype", "float32", "--host-offload-gb", "0.01", "--log-level", "warning"]
        # One torch thread each: two engines, the control plane and the picker share 2 cores.
        env = {**os.environ, **repo_env(), "OMP_NUM_THREADS": "1"}
        super().__init__(argv, logs / f"{self.name}.log", env)

    def ready(self) -> bool:
        with urllib.request.urlopen(self.url + "/ready", timeout=2) as resp:
            return resp.status == 200

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.url + "/metrics")


class Picker(Process):
    """The EPP binary with its Deployment's args (ports made free) and ConfigMap's file."""

    def __init__(
        self, binary: Path, deployment: dict[str, Any], config: str, kubeconfig: Path, logs: Path
    ) -> None:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        args = list(container["args"])
        self.ports = {}
        for flag in ("--grpc-port", "--grpc-health-port", "--metrics-port"):
            self.ports[flag] = free_port()
            args[args.index(flag) + 1] = str(self.ports[flag])
        # The ConfigMap is mounted at the path the args name; here it is a file in logs/.
        config_flag = args.index("--config-file") + 1
        self.config_path = logs / Path(args[config_flag]).name
        self.config_path.write_text(config)
        args[config_flag] = str(self.config_path)
        meta = deployment["metadata"]
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "NAMESPACE": meta["namespace"],
            "POD_NAME": f"{meta['name']}-local",
            "OTEL_SDK_DISABLED": "true",  # its trace exporter would dial a collector
        }
        super().__init__([str(binary), *args], logs / "epp.log", env)
        self.env = env

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.ports['--grpc-port']}"

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(f"http://127.0.0.1:{self.ports['--metrics-port']}/metrics")


class Gateway:
    """Requests through the picker's ext-proc stream, then to the picked engine."""

    def __init__(self, binary: Path, picker: Picker) -> None:
        self.binary, self.picker = binary, picker

    def send(
        self, bodies: list[dict[str, Any]], path: str = "/v1/completions", check: bool = True
    ) -> list[Any]:
        """One result per body: endpoint, status, body; with ``check`` none may be an error."""
        lines = "".join(json.dumps({"path": path, "body": b}) + "\n" for b in bodies)
        proc = subprocess.run(
            [str(self.binary), "--epp", self.picker.grpc_address],
            input=lines, capture_output=True, text=True, timeout=60 + 30 * len(bodies),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        results = [json.loads(line) for line in proc.stdout.splitlines()]
        assert len(results) == len(bodies), proc.stdout
        for r in results:
            assert not check or not r.get("error"), f"{r}\npicker log:\n{self.picker.log()[-3000:]}"
        return results


@dataclass
class Routed:
    """One request through the picker: when it was sent and answered, where, and how."""

    sent: float
    done: float
    engine: str
    status: int
    error: str
    body: str


class Traffic:
    """``threads`` senders, each one request at a time through the gateway, until stopped.

    ``name_of`` names the engine behind a picked endpoint; ``body(worker, n)`` is the request.
    """

    def __init__(
        self,
        gateway: Gateway,
        name_of: Callable[[str], str],
        body: Callable[[int, int], dict[str, Any]],
        threads: int = 2,
    ) -> None:
        self.gateway, self.name_of, self.body = gateway, name_of, body
        self.results: list[Routed] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            sent = time.monotonic()
            (r,) = self.gateway.send([self.body(worker, n)], check=False)
            engine = self.name_of(r["endpoint"]) if r.get("endpoint") else "-"
            status, error, text = r.get("status", 0), r.get("error", ""), r.get("body", "")
            self.results.append(Routed(sent, time.monotonic(), engine, status, error, text))

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def wait_first(self, timeout: float = 120) -> Routed:
        deadline = time.monotonic() + timeout
        while not self.results:
            assert time.monotonic() < deadline, "no request made it through the picker"
            time.sleep(0.1)
        return self.results[0]

    def picks(self, engine: str, start: float, end: float = float("inf")) -> list[Routed]:
        return [r for r in self.results if r.engine == engine and start <= r.sent < end]


def repo_env() -> dict[str, str]:
    """PYTHONPATH for child engines: this checkout's packages, as the tests import them."""
    paths = [ROOT / "engine_pod", ROOT / "operator", ROOT / "kernels", ROOT]
    old = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([*map(str, paths), *([old] if old else [])])}
