"""Test harness: kubectl and the operator process against the emulated cluster, polling waits.

The operator runs for real, as `python -m mstar.operator.main` in a subprocess, so a restart is a
real process restart. Nothing here sleeps a fixed time: every wait polls a condition with a
deadline and says what it was waiting for when it gives up.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # for `tests.prometheus_helper`
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kube_emulator import EmulatedCluster  # noqa: E402

T = TypeVar("T")
CRD = ROOT / "crds" / "mstar.dev_mstardeployments.yaml"
EXAMPLE = ROOT / "examples" / "mstardeployment.yaml"
CRS = Path(__file__).resolve().parent / "crs"
WAIT = 45.0  # generous: CI has 2 shared cores


def wait_for(fn: Callable[[], T | None], what: str, timeout: float = WAIT) -> T:
    """Poll `fn` until it returns something truthy; fail naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except AssertionError as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Kubectl:
    def __init__(self, kubeconfig: Path) -> None:
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        # Discovery is cached per host:port; a port reused by an earlier emulator must not hit.
        self.cache = kubeconfig.parent / "kubectl-cache"

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["kubectl", f"--cache-dir={self.cache}", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc

    def apply(self, path: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
        # Client-side schema download needs /openapi, which the emulator does not serve; the
        # server (the emulator) validates custom resources against the CRD itself.
        return self.run("apply", "--validate=false", "-f", str(path), check=check)

    def patch(self, *target: str, patch: dict[str, Any], subresource: str | None = None) -> None:
        extra = [f"--subresource={subresource}"] if subresource else []
        self.run("patch", *target, "--type", "merge", "-p", json.dumps(patch), *extra)


class Operator:
    """`mstar-operator` as a child process; start/stop it like a pod restart."""

    def __init__(self, kubeconfig: Path, logdir: Path) -> None:
        self.kubeconfig = kubeconfig
        self.logdir = logdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self.liveness = ""
        self.args: list[str] = []

    def start(self) -> None:
        self.starts += 1
        port = free_port()
        self.liveness = f"http://127.0.0.1:{port}/healthz"
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "PYTHONPATH": os.pathsep.join(
                [str(ROOT / "engine_pod"), str(ROOT / "operator"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        log = (self.logdir / f"operator-{self.starts}.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mstar.operator.main", "--liveness", self.liveness, *self.args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        wait_for(self.healthy, "the operator's liveness endpoint")

    def healthy(self) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            raise AssertionError(f"operator exited:\n{self.log()[-3000:]}")
        try:
            with urllib.request.urlopen(self.liveness, timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None

    def log(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(self.logdir.glob("*.log")))


def operator_calls(cluster: EmulatedCluster) -> set[tuple[str, str, str]]:
    """(apiGroup, resource[/subresource], RBAC verb) of every API call not made by kubectl."""

    def read(emu: Any) -> set[tuple[str, str, str]]:
        out = set()
        for req in emu._requests:
            agent = str(req.headers.get("User-Agent", ""))
            if agent.startswith("kubectl") or req.resource is None or not req.resource.plural:
                continue
            method = str(req.method.value if hasattr(req.method, "value") else req.method).upper()
            if method == "GET":
                verb = (
                    "watch"
                    if req.params.get("watch") in ("true", "1")
                    else "get"
                    if req.name
                    else "list"
                )
            else:
                verb = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[
                    method
                ]
            plural = req.resource.plural + (f"/{req.subresource}" if req.subresource else "")
            out.add((req.resource.group or "", plural, verb))
        return out

    return cluster.call(read)
