"""Overload: completed throughput when clients outnumber capacity and ignore `Retry-After`.

Phases against one `mstar-engine serve` (started here on the packaged SmolLM2, or `--url`): each
concurrency of `--concurrency`, then `--flood` clients, each phase `--seconds` long. Every
client posts a chat request (`--max-tokens`, ignore_eos) and, whatever the answer, posts the
next at once: a 429's `Retry-After` is ignored, as guidellm's throughput profile does. Only
requests that complete inside the measured window count, which starts `--warmup` seconds in
(the queue fills, requests reach their steady latency); those still running at its end are
cancelled (the server frees them) and the next phase starts once the server is idle.

Per phase: completed requests, completed output tok/s, 429s, other failures, the median 429
latency seen by the client, and the server's CPU time per answered request. Last: the flood's
tok/s over the best concurrency's (the target is >= 0.8).

    python3 bench/bench_overload.py [--concurrency 16 32 64] [--flood 512] [--seconds 40]
                                    [--warmup 15]
                                    [--max-tokens 64] [--url http://127.0.0.1:8000]
                                    [--server-arg=--max-num-seqs=64 ...] [--root CHECKOUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from bench_all import wait_ready  # noqa: E402  (bench/ is a folder of scripts, not a package)

TOPICS = ("a lighthouse", "the sea", "a robot", "autumn", "a city", "a cat", "bread", "rain")


@dataclass
class Phase:
    """What one phase's clients saw, and the server's CPU seconds meanwhile (None: unknown)."""

    clients: int
    seconds: float
    completed: int = 0
    output_tokens: int = 0
    refused: int = 0
    failed: int = 0
    refusal_latency: list[float] = field(default_factory=list)
    server_cpu: float | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.seconds

    def row(self) -> str:
        p50 = statistics.median(self.refusal_latency) * 1e3 if self.refusal_latency else 0.0
        answered = self.completed + self.refused + self.failed
        cpu = (
            f"{self.server_cpu / answered * 1e3:.2f}"
            if self.server_cpu is not None and answered
            else "-"
        )
        return (
            f"| {self.clients} | {self.completed} | {self.tok_s:.1f} | {self.refused} | "
            f"{self.failed} | {p50:.2f} | {cpu} |"
        )


def chat_body(i: int, max_tokens: int, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [
            {"role": "user", "content": f"Request {i}: write about {TOPICS[i % len(TOPICS)]}."}
        ],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    if model is not None:
        body["model"] = model
    return body


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of process ``pid`` (Linux /proc), or None."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_phase(
    url: str,
    clients: int,
    seconds: float,
    max_tokens: int,
    *,
    warmup: float = 0.0,
    model: str | None = None,
    pid: int | None = None,
) -> Phase:
    """``clients`` back-to-back posters for ``warmup`` + ``seconds``, counted over the last
    ``seconds``; see the module docstring."""
    phase = Phase(clients, seconds)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    counter = iter(range(1 << 62))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        begin = time.monotonic() + warmup
        end = begin + seconds
        cpu: list[float | None] = []

        async def measure() -> None:
            await asyncio.sleep(warmup)
            cpu.append(cpu_seconds(pid))

        async def client() -> None:
            while time.monotonic() < end:
                sent = time.monotonic()
                body = chat_body(next(counter), max_tokens, model)
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    data = await resp.read()
                now = time.monotonic()
                if now > end:
                    return  # finished after the window: not this phase's
                if now < begin:
                    continue  # warming up
                if resp.status == 200:
                    phase.completed += 1
                    phase.output_tokens += json.loads(data)["usage"]["completion_tokens"]
                elif resp.status == 429:
                    phase.refused += 1
                    phase.refusal_latency.append(now - sent)
                else:
                    phase.failed += 1

        tasks = [asyncio.create_task(client()) for _ in range(clients)]
        await asyncio.wait([*tasks, asyncio.create_task(measure())], timeout=end - time.monotonic())
        cpu.append(cpu_seconds(pid))
        for task in tasks:
            task.cancel()  # in flight at the window's end: disconnect, the server aborts it
        await asyncio.gather(*tasks, return_exceptions=True)
    if len(cpu) == 2 and cpu[0] is not None and cpu[1] is not None:
        phase.server_cpu = cpu[1] - cpu[0]
    return phase


def server_busy(url: str) -> float:
    """Requests running plus waiting, from `/metrics`."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("mstar:num_requests_running{", "mstar:num_requests_waiting{")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_idle(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while server_busy(url) > 0:
        if time.monotonic() > deadline:
            raise RuntimeError("the server never went idle between phases")
        time.sleep(0.2)


def start_server(port: int, extra: list[str], log: Path, root: Path) -> subprocess.Popen[bytes]:
    path = os.pathsep.join(str(root / d) for d in ("engine_pod", "kernels", "operator"))
    cmd = [sys.executable, "-m", "mstar.engine.cli", "serve", "--port", str(port)]
    return subprocess.Popen(
        [*cmd, "--log-level", "warning", *extra],
        env={**os.environ, "PYTHONPATH": path},
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )


HEADER = (
    "| clients | completed | completed tok/s | 429 | failed | 429 p50 ms | server CPU ms/answer |\n"
    "|---:|---:|---:|---:|---:|---:|---:|"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--flood", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=40.0, help="Measured, per phase.")
    ap.add_argument("--warmup", type=float, default=15.0, help="Unmeasured, per phase.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--url", default=None, help="A running server (default: start one here).")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--server-arg", action="append", default=[], help="Passed to serve.")
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="Serve another checkout's engine (A/B runs)."
    )
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    log = Path("/tmp/bench_overload_server.log")
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        proc = start_server(args.port, args.server_arg, log, args.root)
    try:
        if proc is not None:
            wait_ready(url, proc, log)
        print(f"loadavg before: {Path('/proc/loadavg').read_text().strip()}")
        phases = []
        for clients in [*args.concurrency, args.flood]:
            pid = proc.pid if proc is not None else None
            run = run_phase(
                url, clients, args.seconds, args.max_tokens, warmup=args.warmup, pid=pid
            )
            phase = asyncio.run(run)
            phases.append(phase)
            print(HEADER if len(phases) == 1 else "", end="\n" if len(phases) == 1 else "")
            print(phase.row(), flush=True)
            wait_idle(url)
        best = max(phases[:-1], key=lambda p: p.tok_s)
        ratio = phases[-1].tok_s / best.tok_s if best.tok_s else 0.0
        print(
            f"flood of {args.flood}: {phases[-1].tok_s:.1f} completed tok/s = {ratio:.2f} x the "
            f"best concurrency ({best.clients}: {best.tok_s:.1f} tok/s); target >= 0.80"
        )
        print(f"loadavg after: {Path('/proc/loadavg').read_text().strip()}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
