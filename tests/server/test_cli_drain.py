"""`mstar-engine serve` as a real process: flags, MSTAR_API_KEY, SIGTERM drain and exit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mstar.engine.cli import build_parser
from mstar.engine.config import from_namespace

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_flags_parse_into_engine_config() -> None:
    args = build_parser().parse_args(
        ["serve", "/m", "--port", "9001", "--num-pages", "64", "--api-key", "k"]
    )
    config = from_namespace(args)
    assert (config.model, config.port, config.num_pages) == ("/m", 9001, 64)
    assert args.api_key == "k"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--port", "x"])


class Proc:
    """`mstar-engine serve MODEL` on the tiny model's flags; ``program`` runs it another way
    (tests/faults runs it through its fault launcher)."""

    def __init__(
        self,
        log: Path,
        model: Path,
        *extra: str,
        env: dict[str, str] | None = None,
        program: tuple[str, ...] = (sys.executable, "-m", "mstar.engine.cli"),
    ) -> None:
        self.port = free_port()
        self.log_path = log
        self.log = log.open("wb")
        self.url = f"http://127.0.0.1:{self.port}"
        path = os.pathsep.join(str(ROOT / d) for d in ("engine_pod", "kernels", "operator"))
        self.proc = subprocess.Popen(
            [
                *program,
                "serve",
                str(model),
                "--port",
                str(self.port),
                "--device",
                "cpu",
                "--num-pages",
                "128",
                "--page-size",
                "4",
                "--served-model-name",
                "tiny",
                "--no-enable-prefix-caching",
                # A small host pool keeps the KV debug checks (on in tests) cheap per step.
                "--host-offload-gb",
                "0.001",
                "--log-level",
                "warning",
                *extra,
            ],
            env={**os.environ, "PYTHONPATH": path, **(env or {})},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def request(
        self, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.log_path.read_text()}")
            try:
                if self.request("/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError("server never became ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def proc_factory(tmp_path: Path) -> Iterator[Any]:
    procs: list[Proc] = []

    def make(*args: Any, **kw: Any) -> Proc:
        p = Proc(tmp_path / f"server-{len(procs)}.log", *args, **kw)
        procs.append(p)
        return p

    yield make
    for p in procs:
        p.stop()


AUTH = {"Authorization": "Bearer k"}


def test_sigterm_drains_in_flight_then_exits(tiny_chat_dir: Path, proc_factory: Any) -> None:
    p = proc_factory(tiny_chat_dir, "--shutdown-grace-seconds", "60", env={"MSTAR_API_KEY": "k"})
    p.wait_ready()
    assert p.request("/v1/models")[0] == 401  # the key came from MSTAR_API_KEY
    assert p.request("/v1/models", headers=AUTH)[0] == 200

    result: dict[str, Any] = {}
    body = {"model": "tiny", "prompt": "w7 w8", "max_tokens": 300, "ignore_eos": True}

    def long_request() -> None:
        result["status"], result["body"] = p.request("/v1/completions", body, AUTH)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while b'mstar:num_requests_running{model_name="tiny"} 1.0' not in p.request("/metrics")[1]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while p.request("/ready")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, refused = p.request("/v1/completions", body, AUTH)
    assert status == 503 and json.loads(refused)["error"]["type"] == "service_unavailable"
    assert p.request("/health")[0] == 200  # draining is not dying
    worker.join(120)
    assert result.get("status") == 200, p.log_path.read_text()
    done = json.loads(result["body"])
    assert done["choices"][0]["finish_reason"] == "length"
    assert done["usage"]["completion_tokens"] == 300
    assert p.proc.wait(30) == 0


def test_sigterm_cuts_off_after_the_grace_period(tiny_chat_dir: Path, proc_factory: Any) -> None:
    # A short grace: the tiny model decodes ~1 ms per token on a quiet core, so 500 tokens
    # (its 512 positions allow no more) could finish inside a grace of 0.5 s.
    p = proc_factory(tiny_chat_dir, "--shutdown-grace-seconds", "0.1", "--max-model-len", "512")
    p.wait_ready()
    body = {"model": "tiny", "prompt": "w7", "max_tokens": 500, "ignore_eos": True}
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["status"], result["body"] = p.request("/v1/completions", body)

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while b'mstar:num_requests_running{model_name="tiny"} 1.0' not in p.request("/metrics")[1]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    assert p.proc.wait(30) == 0
    assert time.monotonic() - started < 15
    worker.join(30)
    # The client gets what was generated before the cut, marked as aborted.
    assert result["status"] == 200
    cut = json.loads(result["body"])
    assert cut["choices"][0]["finish_reason"] == "abort"
    assert 0 < cut["usage"]["completion_tokens"] < 500


def _stream(p: Proc, body: dict[str, Any]) -> dict[str, Any]:
    """One SSE completion read to its end: token count, finish reason, whether [DONE] came."""
    req = urllib.request.Request(
        p.url + "/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json"},
    )
    out: dict[str, Any] = {"chunks": 0, "finish_reason": None, "done": False}
    with urllib.request.urlopen(req, timeout=120) as resp:
        out["status"] = resp.status
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            choice = json.loads(line[6:])["choices"][0]
            out["chunks"] += 1
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def test_sigterm_during_16_streams_completes_every_stream(
    tiny_chat_dir: Path, proc_factory: Any
) -> None:
    """The rollout contract: SIGTERM -> /ready 503 at once, late requests 503 + Retry-After,
    and every stream already running finishes with all its tokens before the process exits."""
    streams, tokens = 16, 400
    p = proc_factory(tiny_chat_dir, "--shutdown-grace-seconds", "120", "--num-pages", "2048")
    p.wait_ready()
    body = {"model": "tiny", "prompt": "w7 w8", "max_tokens": tokens, "ignore_eos": True}
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = _stream(p, body)
        except Exception as exc:  # reported below with the index
            results[i] = exc

    workers = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    for w in workers:
        w.start()
    running = f'mstar:num_requests_running{{model_name="tiny"}} {float(streams)}'.encode()
    deadline = time.monotonic() + 60
    while running not in p.request("/metrics")[1]:
        assert time.monotonic() < deadline, "the 16 streams never ran together"
        time.sleep(0.02)
    p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while p.request("/ready")[0] != 503:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    req = urllib.request.Request(
        p.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    still_streaming = sum(w.is_alive() for w in workers)
    assert refused.value.code == 503
    assert refused.value.headers["Retry-After"] == "1"
    assert json.loads(refused.value.read())["error"]["type"] == "service_unavailable"
    assert still_streaming > 0, "the refusal came after the drain, not during it"
    for w in workers:
        w.join(180)
    assert p.proc.wait(60) == 0
    for i in range(streams):
        assert results[i] == {
            "status": 200,
            "chunks": tokens,
            "finish_reason": "length",
            "done": True,
        }, (i, results[i], p.log_path.read_text()[-2000:])


def _prestop(p: Proc, *args: str) -> subprocess.Popen[str]:
    path = os.pathsep.join(str(ROOT / d) for d in ("engine_pod", "kernels", "operator"))
    return subprocess.Popen(
        [sys.executable, "-m", "mstar.engine.cli", "prestop", "--port", str(p.port), *args],
        env={**os.environ, "PYTHONPATH": path},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_prestop_returns_once_requests_stop_arriving(
    tiny_chat_dir: Path, proc_factory: Any
) -> None:
    """The preStop hook holds SIGTERM back while traffic still arrives, then lets it go."""
    p = proc_factory(tiny_chat_dir)
    p.wait_ready()
    body = {"model": "tiny", "prompt": "w7", "max_tokens": 1}
    hook = _prestop(p, "--quiet-seconds", "2", "--timeout-seconds", "120")
    started = time.monotonic()
    for _ in range(150):  # back to back: the gaps are milliseconds, far below the quiet spell
        last_sent = time.monotonic()
        assert p.request("/v1/completions", body)[0] == 200
        assert hook.poll() is None, "the hook returned while requests were still arriving"
    out, _ = hook.communicate(timeout=60)
    assert hook.returncode == 0
    assert "out of rotation: no request for" in out
    # The quiet spell is counted from the last request's arrival (sent at `last_sent`; under load
    # its answer can come back tens of ms later, so the client's end time is no bound).
    assert time.monotonic() - last_sent >= 2
    assert last_sent > started
    # The server kept serving through the hook; it drains only on the SIGTERM that follows.
    assert p.request("/ready")[0] == 200

    # An idle server still gets the full quiet spell (routers may not have let go yet), and a
    # never-quiet one is let go at the timeout.
    t0 = time.monotonic()
    idle = _prestop(p, "--quiet-seconds", "1")
    assert "no request for" in idle.communicate(timeout=60)[0]
    assert time.monotonic() - t0 >= 1
    capped = _prestop(p, "--quiet-seconds", "60", "--timeout-seconds", "0.5")
    assert "timed out after" in capped.communicate(timeout=60)[0]
    assert capped.returncode == 0
