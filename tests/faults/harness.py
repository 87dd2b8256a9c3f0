"""`FaultyServer`: a real `mstar-engine serve` process whose engine step can be broken on cue."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAUNCHER = Path(__file__).with_name("fault_launcher.py")

#: The tiny model's serving flags: a small pool, no prefix cache (every page comes back).
TINY_FLAGS = (
    "--device",
    "cpu",
    "--dtype",
    "float32",
    "--num-pages",
    "256",
    "--page-size",
    "4",
    "--served-model-name",
    "tiny",
    "--no-enable-prefix-caching",
    "--host-offload-gb",
    "0.001",
    "--log-level",
    "warning",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FaultyServer:
    """`mstar-engine serve MODEL` through `fault_launcher.py`; `inject` breaks its step."""

    def __init__(self, folder: Path, model: Path, *extra: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.switch = folder / "fault"
        self.log_path = folder / "server.log"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.pathsep.join(str(ROOT / d) for d in ("engine_pod", "kernels", "operator"))
        self._log = self.log_path.open("wb")
        command = [sys.executable, str(LAUNCHER), str(self.switch), "serve", str(model)]
        self.proc = subprocess.Popen(
            [*command, *TINY_FLAGS, "--port", str(self.port), *extra],
            env={**os.environ, "PYTHONPATH": path},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def inject(self, fault: str) -> float:
        """Break the next step (``hang`` or ``raise``); returns when (monotonic)."""
        self.switch.write_text(fault)
        return time.monotonic()

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def post(self, path: str, body: Any, timeout: float = 30.0) -> tuple[int, Any, Any]:
        """(status, JSON body, headers)."""
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read()), resp.headers
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}"), err.headers

    def metric(self, name: str) -> float:
        """The value of an unlabelled-but-for-model_name gauge or counter from `/metrics`."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.log_path.read_text()}")
            try:
                if self.get("/ready", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise AssertionError("server never became ready")

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal(self, sig: signal.Signals) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.close()


#: Each case's account, printed at the end of the run (`conftest.pytest_terminal_summary`).
ACCOUNTS: list[str] = []


def record(case: str, account: object, **measured: float | str) -> None:
    figures = "".join(
        f"; {k.replace('_', ' ')} {v:.2f}" if isinstance(v, float) else f"; {k} {v}"
        for k, v in measured.items()
    )
    ACCOUNTS.append(f"{case}: {account}{figures}")
