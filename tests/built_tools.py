"""Programs the tests run for real, built from their Go modules by `scripts/cluster.sh
build-tools` into the cache (the endpoint picker, Jaeger, prometheus-adapter), and a way to run
one as a child process with its output in a log file."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from external_tools import require_tool

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SH = ROOT / "scripts" / "cluster.sh"
T = TypeVar("T")


def tool_bin(tool: str) -> Path:
    """The bin folder of `tool` (epp, jaeger, adapter, lws), built first if the cache lacks it."""
    require_tool("go")
    proc = subprocess.run(
        ["bash", str(CLUSTER_SH), "build-tools", tool],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"cluster.sh build-tools {tool} failed:\n{proc.stderr[-4000:]}")
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(f"{tool}=")]
    return Path(line.split("=", 1)[1])


def module_version(binary: Path, module: str) -> str:
    """The version of `module` compiled into a Go binary (`go version -m`)."""
    out = subprocess.run(
        ["go", "version", "-m", str(binary)], capture_output=True, text=True, check=True
    ).stdout
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] in {"dep", "mod"} and fields[1] == module:
            return fields[2]
    raise AssertionError(f"{binary} has no module {module}:\n{out}")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Process:
    """A child process with its output in a log file; stopped by its pid."""

    def __init__(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.argv, self.log_path = argv, log
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, env=env or dict(os.environ)
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()


def wait_until(
    check: Callable[[], T | None], what: str, timeout: float, process: Process | None = None
) -> T:
    """Poll `check` until it returns something truthy (errors count as not yet)."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None and not process.alive():
            raise AssertionError(f"{what}: the process exited:\n{process.log()[-4000:]}")
        try:
            value = check()
        except (OSError, AssertionError, KeyError, ValueError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            tail = process.log()[-4000:] if process is not None else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.2)
