"""Overload: 512 clients that ignore `Retry-After` still get the admitted work served.

`bench/bench_overload.py`'s load, shortened: the best completed throughput of a few
concurrencies, then the flood; then what one refusal costs the server, measured as its CPU time
while the engine is held (a hung step, no stall check) and only refusals are being answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import aiohttp

from bench.bench_overload import chat_body, cpu_seconds, run_phase, wait_idle
from faults.harness import FaultyServer, record

Start = Callable[..., FaultyServer]
WAITING = 32
#: The least the flood's completed output tok/s may keep of the best concurrency's. The issue's
#: 0.8 is a benchmark target (`bench/bench_overload.py` on SmolLM2, where the engine's work
#: dominates); here the tiny model's steps are so short that the 512-client load generator,
#: sharing the two cores, costs the server a share of its rate (0.62-0.75 in a quiet
#: clean-clone run). Before the early 429 the flood kept 0.14, so this bound still fails on a
#: collapse.
FLOOD_RATIO = 0.5


async def refusal_cost(server: FaultyServer, refusals: int) -> tuple[float, int]:
    """(server CPU seconds per answer, answers that were 429) over ``refusals`` requests sent
    256 at a time to a server whose waiting queue is full and whose engine is held."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:

        async def status(path: str, body: dict[str, Any]) -> int:
            async with session.post(server.url + path, json=body) as r:
                await r.read()
                return r.status

        # The engine is held: the first WAITING of these wait for good, the rest are refused.
        holders = [
            asyncio.create_task(status("/v1/completions", {"prompt": [5, i % 90]}))
            for i in range(WAITING + 8)
        ]
        done, _ = await asyncio.wait(holders, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert done and {t.result() for t in done} == {429}, "the queue never filled"
        counter = iter(range(refusals))
        statuses: list[int] = []

        async def client() -> None:
            for i in counter:
                statuses.append(await status("/v1/chat/completions", chat_body(i, 8, "tiny")))

        before = cpu_seconds(server.proc.pid)
        await asyncio.gather(*(client() for _ in range(256)))
        after = cpu_seconds(server.proc.pid)
        for task in holders:
            task.cancel()
    assert before is not None and after is not None
    return (after - before) / refusals, statuses.count(429)


def test_a_flood_keeps_the_admitted_work_served(faulty_server: Start) -> None:
    server = faulty_server("--max-waiting-requests", str(WAITING), "--stall-timeout-seconds", "0")
    phases = []
    # 64: the engine's --max-num-seqs. Two tries each side: the machine is shared.
    for clients in (32, 512, 64, 512):
        run = run_phase(server.url, clients, 6.0, 16, warmup=6.0, model="tiny")
        phases.append(asyncio.run(run))
        wait_idle(server.url)
    best = max((p for p in phases if p.clients < 512), key=lambda p: p.tok_s)
    flood = max((p for p in phases if p.clients == 512), key=lambda p: p.tok_s)
    ratio = flood.tok_s / best.tok_s
    assert flood.refused > 0 and flood.failed == 0, flood
    assert ratio >= FLOOD_RATIO, [p.row() for p in phases]
    assert server.metric("mstar:kv_cache_usage_perc") == 0.0  # everything cut off came back

    server.inject("hang")
    per_refusal, refused = asyncio.run(refusal_cost(server, 1000))
    assert refused == 1000
    assert per_refusal < 1e-3, per_refusal
    record(
        "overload",
        f"best {best.clients} clients {best.tok_s:.0f} tok/s ({best.completed} done); "
        f"flood 512: {flood.tok_s:.0f} tok/s ({flood.completed} done, {flood.refused} 429, "
        f"{flood.failed} failed)",
        flood_ratio=ratio,
        server_cpu_ms_per_429=per_refusal * 1e3,
    )
