"""An engine killed while the real endpoint picker routes to it (the fault suite's control-plane
case; the engine-process faults are in tests/faults).

Two real engines on their kwok pod addresses behind the real picker (`test_epp.pool`), steady
traffic through its ext-proc stream. One engine is SIGKILLed: what the picker sends there must
fail at once (connection refused), never hang. kwok runs no probes, so the test then does what
the kubelet's readiness probe would do after its misses (`readinessProbe`: 3 x 5 s): mark the
pod NotReady, and measures how soon the picker stops choosing it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from real_cluster import ControlPlane
from test_epp import MODEL, Pool, pool

__all__ = ["pool"]  # the fixture, one per module
pytestmark = pytest.mark.usefixtures("real_operator")


@dataclass
class Routed:
    """One request through the picker: when it was sent and answered, where, and how."""

    sent: float
    done: float
    engine: str
    status: int
    error: str


class Traffic:
    """``threads`` senders, each one request at a time through the gateway, until stopped."""

    def __init__(self, pool: Pool, threads: int = 2) -> None:
        self.pool = pool
        self.results: list[Routed] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": MODEL, "prompt": f"w{5 + worker} w{10 + n % 80}", "max_tokens": 8}
            sent = time.monotonic()
            (r,) = self.pool.gateway.send([body], check=False)
            engine = self.pool.by_endpoint(r["endpoint"]).name if r.get("endpoint") else "-"
            self.results.append(
                Routed(sent, time.monotonic(), engine, r.get("status", 0), r.get("error", ""))
            )

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def picks(self, engine: str, start: float, end: float = float("inf")) -> list[Routed]:
        return [r for r in self.results if r.engine == engine and start <= r.sent < end]


def mark_not_ready(cp: ControlPlane, pod: str, namespace: str) -> float:
    """What the kubelet writes once the readiness probe has failed its threshold."""
    patch: dict[str, Any] = {"status": {"conditions": [{"type": "Ready", "status": "False"}]}}
    cp.kubectl(
        "patch", "pod", pod, "-n", namespace, "--subresource=status", "-p", json.dumps(patch)
    )
    return time.monotonic()


def test_an_engine_killed_under_traffic_fails_fast_and_leaves_the_pool(
    pool: Pool, control_plane: ControlPlane
) -> None:
    namespace = "epp-faults"
    with Traffic(pool) as traffic:
        deadline = time.monotonic() + 120
        while not traffic.results:
            assert time.monotonic() < deadline, "no request made it through the picker"
            time.sleep(0.1)
        victim = next(e for e in pool.engines if e.name == traffic.results[0].engine)
        survivor = pool.other(victim)
        victim.proc.kill()
        killed = time.monotonic()
        time.sleep(3.0)  # the picker on its own: its scrapes of the victim now fail
        not_ready = mark_not_ready(control_plane, victim.name, namespace)
        time.sleep(3.5)  # kwok's ready stage turns the pod Ready again after 5 s
    results = traffic.results
    after_kill = traffic.picks(victim.name, killed, not_ready)
    after_not_ready = traffic.picks(victim.name, not_ready + 1.0)
    # Nothing hangs: every request sent to the dead engine failed within a second.
    for r in traffic.picks(victim.name, killed + 0.05):
        assert r.status == 0 and r.error, r
        assert r.done - r.sent < 1.0, r
    assert all(r.status == 200 for r in traffic.picks(survivor.name, 0.0)), results
    assert traffic.picks(survivor.name, not_ready + 1.0), "the survivor took nothing"
    assert after_not_ready == [], f"picked {len(after_not_ready)} times after NotReady + 1 s"
    last = max((r.sent for r in traffic.picks(victim.name, not_ready)), default=not_ready)
    print(
        f"\nengine killed under traffic: {len(after_kill)} picks of the dead engine in the "
        f"{not_ready - killed:.1f} s before NotReady (each failed in "
        f"<= {max((r.done - r.sent for r in after_kill), default=0.0):.2f} s); the last pick "
        f"{last - not_ready:.2f} s after NotReady; {len(results)} requests in all"
    )
