"""`FaultyServer`: a real `mstar-engine serve` process whose engine step can be broken on cue."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from server.test_cli_drain import Proc

LAUNCHER = Path(__file__).with_name("fault_launcher.py")


class FaultyServer(Proc):
    """`mstar-engine serve MODEL` through `fault_launcher.py`; `inject` breaks its step."""

    def __init__(self, folder: Path, model: Path, *extra: str) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.switch = folder / "fault"
        # 256 pages (Proc's 128 are few for 8 streams), float32 as in every tiny-model test.
        flags = ("--num-pages", "256", "--dtype", "float32", *extra)
        program = (sys.executable, str(LAUNCHER), str(self.switch))
        super().__init__(folder / "server.log", model, *flags, program=program)

    def inject(self, fault: str) -> float:
        """Break the next step (``hang`` or ``raise``); returns when (monotonic)."""
        self.switch.write_text(fault)
        return time.monotonic()

    def get(self, path: str) -> tuple[int, dict[str, Any]]:
        status, body = self.request(path)
        return status, json.loads(body or b"{}")

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, raw = self.request(path, body)
        return status, json.loads(raw or b"{}")

    def metric(self, name: str) -> float:
        """A gauge or counter labelled only by model_name, from `/metrics`."""
        for line in self.request("/metrics")[1].decode().splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def wait_exit(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def signal(self, sig: signal.Signals) -> float:
        self.proc.send_signal(sig)
        return time.monotonic()

    def server_log(self) -> str:
        return self.log_path.read_text(errors="replace")


#: Each case's account, printed at the end of the run (`conftest.pytest_terminal_summary`).
ACCOUNTS: list[str] = []


def record(case: str, account: object, **measured: float | str) -> None:
    figures = "".join(
        f"; {k.replace('_', ' ')} {v:.2f}" if isinstance(v, float) else f"; {k} {v}"
        for k, v in measured.items()
    )
    ACCOUNTS.append(f"{case}: {account}{figures}")
