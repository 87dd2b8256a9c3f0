"""The container images, built from this repository by scripts/build-images.sh with no registry,
run for real: the CPU engine image serves /health and a completion with its prebuilt C++ kernels
(no compiler inside: the best level this CPU runs, or the one MSTAR_CPU_ISA names) and drains on
stop; the operator image reconciles the emulated cluster. The Dockerfiles pass hadolint.

The first build took 9 minutes on 2 busy cores (load ~11; base rootfs, 3.5 GB of pinned wheels,
torch's CUDA libraries included, both images); the script labels each image with a hash of its
inputs, so later runs reuse them in a second.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chart_render import granted_rules
from external_tools import require_tool
from kube_emulator import EmulatedCluster
from op_harness import ROOT, Kubectl, free_port, operator_calls, wait_for

from mstar.kernels import cpu_isa

TOOLS = ("podman", "mmdebstrap", "runc")
BUILD_TIMEOUT = 1500
ENGINE = "localhost/mstar-engine-cpu:0.1.0"
OPERATOR = "localhost/mstar-operator:0.1.0"


def _missing_tools() -> list[str]:
    return [tool for tool in TOOLS if shutil.which(tool) is None]


needs_builders = pytest.mark.skipif(
    bool(_missing_tools()),
    reason=f"cannot build images here: {', '.join(_missing_tools())} not installed "
    "(scripts/install-test-tools.sh installs them)",
)


def podman(
    *args: str, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    conf = Path(os.environ.get("MSTAR_CACHE", Path.home() / ".cache" / "mstar")) / "images"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "containers.conf").write_text("[containers]\ndefault_ulimits = []\n")
    env = {**os.environ, "CONTAINERS_CONF": str(conf / "containers.conf")}
    proc = subprocess.run(
        ["podman", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed: {proc.stdout}{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def images() -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "build-images.sh"), "operator", "engine-cpu"],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert proc.stdout.split() == [OPERATOR, ENGINE]


class Container:
    """A detached container on the host network; removed when the test ends."""

    def __init__(self, image: str, *args: str, options: tuple[str, ...] = ()) -> None:
        self.name = f"mstar-test-{uuid.uuid4().hex[:8]}"
        podman("run", "-d", "--runtime", "runc", "--network", "host", "--name", self.name,
               *options, image, *args)  # fmt: skip

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def running(self) -> bool:
        state = podman("inspect", "--format", "{{.State.Running}}", self.name).stdout.strip()
        if state != "true":
            raise AssertionError(f"container exited:\n{self.logs()[-4000:]}")
        return True

    def remove(self) -> None:
        podman("rm", "-f", "-t", "0", self.name, check=False)


@pytest.fixture()
def containers() -> Iterator[list[Container]]:
    started: list[Container] = []
    yield started
    for c in started:
        c.remove()


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def _start_engine(containers: list[Container], *options: str) -> tuple[Container, int, Any]:
    """A CPU engine container, once its /health answers 200: (it, its port, that answer)."""
    port = free_port()
    engine = Container(ENGINE, "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                       options=options)  # fmt: skip
    containers.append(engine)
    url = f"http://127.0.0.1:{port}"
    health: list[Any] = []

    def healthy() -> bool:
        engine.running()
        try:
            status, body = _get(url + "/health")
        except OSError:
            return False
        health.append(body)
        return status == 200

    # The packaged SmolLM2 is converted and loaded on first start inside the container.
    wait_for(healthy, "the engine container's /health", timeout=240)
    return engine, port, health[-1]


@needs_builders
def test_cpu_engine_image_serves_a_completion_and_drains(
    images: None, containers: list[Container]
) -> None:
    engine, port, health = _start_engine(containers)
    url = f"http://127.0.0.1:{port}"
    # The image has no compiler: the kernels are the ones its build stage made, for this CPU.
    best = cpu_isa.best_level(cpu_isa.detect()).name
    assert health["cpu_isa"] == best, engine.logs()[-4000:]
    assert "no C++ compiler here; loading the prebuilt /opt/mstar/kernels/" in engine.logs()
    assert f"CPU kernels: ISA level {best}" in engine.logs()
    status, models = _get(url + "/v1/models")
    assert status == 200
    (model,) = models["data"]
    body = json.dumps(
        {"model": model["id"], "prompt": "The capital of France is", "max_tokens": 8}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        done = json.loads(resp.read())
    assert done["usage"]["completion_tokens"] == 8
    assert done["choices"][0]["text"].strip()
    # The preStop hook the operator renders runs inside the image.
    hook = podman("exec", engine.name, "mstar-engine", "prestop", "--port", str(port),
                  "--quiet-seconds", "0.5")  # fmt: skip
    assert "out of rotation" in hook.stdout
    # SIGTERM (podman stop) drains and exits cleanly, well inside the grace period.
    started = time.monotonic()
    podman("stop", "-t", "60", engine.name, timeout=90)
    code = podman("inspect", "--format", "{{.State.ExitCode}}", engine.name).stdout.strip()
    assert code == "0", engine.logs()[-4000:]
    assert time.monotonic() - started < 60


@needs_builders
def test_cpu_engine_image_runs_the_level_named(images: None, containers: list[Container]) -> None:
    """The same image runs another level's build: MSTAR_CPU_ISA=avx2 on any AVX2 CPU."""
    if "x86-64-v3" not in [lvl.name for lvl in cpu_isa.supported_levels(cpu_isa.detect())]:
        pytest.skip("this CPU has no AVX2")
    engine, _, health = _start_engine(containers, "--env=MSTAR_CPU_ISA=avx2")
    assert health["cpu_isa"] == "x86-64-v3", engine.logs()[-4000:]


@needs_builders
def test_operator_image_reconciles_the_emulated_cluster(
    images: None, containers: list[Container], tmp_path: Path
) -> None:
    require_tool("kubectl")
    with EmulatedCluster(tmp_path) as cluster:
        kubectl = Kubectl(cluster.kubeconfig)
        kubectl.apply(ROOT / "crds" / "mstar.dev_mstardeployments.yaml")
        cluster.kubeconfig.chmod(0o644)  # the image runs as uid 1000
        port = free_port()
        operator = Container(
            OPERATOR,
            f"--liveness=http://127.0.0.1:{port}/healthz",
            options=(
                f"--volume={cluster.kubeconfig}:/etc/mstar/kubeconfig:ro",
                "--env=KUBECONFIG=/etc/mstar/kubeconfig",
            ),
        )
        containers.append(operator)

        def live() -> bool:
            operator.running()
            try:
                return _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
            except (OSError, ValueError):
                return False

        wait_for(live, "the operator container's liveness endpoint", timeout=120)
        kubectl.apply(ROOT / "examples" / "mstardeployment-cpu.yaml")
        dep = wait_for(
            lambda: cluster.get("apps/v1/deployments", "default", "smollm2-cpu"),
            "the Deployment from the operator container",
        )
        assert dep["spec"]["template"]["spec"]["containers"][0]["command"] == [
            "mstar-engine",
            "serve",
        ]
        require_tool("helm")  # the container needs no more than the chart's ClusterRole grants
        assert operator_calls(cluster) - granted_rules() == set()
        operator.remove()  # before the cluster goes: its watches would hold the server open


def test_dockerfiles_pass_hadolint() -> None:
    require_tool("hadolint")
    files = [ROOT / "engine_pod" / "Dockerfile", ROOT / "operator" / "Dockerfile"]
    proc = subprocess.run(
        ["hadolint", *map(str, files)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_build_script_passes_shellcheck() -> None:
    require_tool("shellcheck")
    script = ROOT / "scripts" / "build-images.sh"
    proc = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
