"""A burst against `mstar-engine serve` on a tiny KV pool and on the default one, as users send it.

60 chat requests (prompts of 25-70 words, 16-40 new tokens with ignore_eos) sent at once with a
180 s client timeout, first to a server started with `--num-pages 40 --page-size 16
--max-num-seqs 16 --host-offload-gb 0.001` (a pool of 640 tokens; the host pool holds two
pages, so nearly every victim is recomputed), then to one with the default pool. Reports wall
time, timeouts, and evictions / recomputations per request read from the server's `/metrics`.

    python bench/bench_burst.py [--requests 60] [--port 8431]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import subprocess
import sys
import time
import urllib.request

import aiohttp

TINY = [
    "--num-pages",
    "40",
    "--page-size",
    "16",
    "--max-num-seqs",
    "16",
    "--host-offload-gb",
    "0.001",
]
WORDS = ["apple", "river", "stone", "cloud", "garden", "music", "silver", "engine", "window"]


def prompts(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [
        (" ".join(rng.choice(WORDS) for _ in range(rng.randint(25, 70))), rng.randint(16, 40))
        for _ in range(n)
    ]


def metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    values = [
        float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}\{{.*\}} (\S+)$", text, re.M)
    ]
    if not values:
        raise SystemExit(f"/metrics has no {name}")
    return sum(values)


async def burst(base: str, work: list[tuple[str, int]], timeout: float) -> tuple[float, int]:
    async def one(session: aiohttp.ClientSession, text: str, n: int) -> bool:
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": n,
            "ignore_eos": True,
            "temperature": 0,
        }
        try:
            async with session.post(base + "/v1/chat/completions", json=body) as resp:
                data = await resp.json()
                return resp.status == 200 and data["usage"]["completion_tokens"] == n
        except TimeoutError:
            return False

    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with aiohttp.ClientSession(timeout=client_timeout) as session:
        start = time.perf_counter()
        ok = await asyncio.gather(*(one(session, t, n) for t, n in work))
        return time.perf_counter() - start, sum(not x for x in ok)


def run(flags: list[str], port: int, work: list[tuple[str, int]], timeout: float) -> dict:
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mstar.engine.cli", "serve", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(base + "/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        wall, failed = asyncio.run(burst(base, work, timeout))
        return {
            "wall_s": wall,
            "failed": failed,
            "evictions": metric(base, "mstar:evictions_total"),
            "recomputations": metric(base, "mstar:recomputations_total"),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--port", type=int, default=8431)
    ap.add_argument("--timeout", type=float, default=180.0)
    args = ap.parse_args()
    work = prompts(args.requests)
    rows = {
        "tiny pool": run(TINY, args.port, work, args.timeout),
        "default pool": run([], args.port, work, args.timeout),
    }
    print("| pool | wall s | failed or timed out | evictions/request | recomputations/request |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows.items():
        n = args.requests
        print(
            f"| {name} | {r['wall_s']:.1f} | {r['failed']} | {r['evictions'] / n:.2f} | "
            f"{r['recomputations'] / n:.2f} |"
        )
    ratio = rows["tiny pool"]["wall_s"] / rows["default pool"]["wall_s"]
    print(f"tiny / default wall time: {ratio:.2f}x")


if __name__ == "__main__":
    main()
