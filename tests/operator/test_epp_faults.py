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
import time
from typing import Any

import pytest
from epp_harness import Traffic
from real_cluster import ControlPlane
from test_epp import MODEL, Pool, pool

from mstar.operator.router import METRICS_STALENESS_SECONDS

__all__ = ["pool"]  # the fixture, one per module
pytestmark = pytest.mark.usefixtures("real_operator")


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

    def body(worker: int, n: int) -> dict[str, Any]:
        return {"model": MODEL, "prompt": f"w{5 + worker} w{10 + n % 80}", "max_tokens": 8}

    with Traffic(pool.gateway, lambda ep: pool.by_endpoint(ep).name, body) as traffic:
        victim = next(e for e in pool.engines if e.name == traffic.wait_first().engine)
        survivor = pool.other(victim)
        victim.proc.kill()
        killed = time.monotonic()
        time.sleep(3.0)  # the picker on its own: its scrapes of the victim now fail, and its
        # staleness filter drops the victim once its last good scrape is 1 s old
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
    # The staleness filter, not NotReady, took it out: no pick once its metrics were stale
    # (the bound, plus the last good scrape's age at the kill and a loaded machine's slack).
    last = max((r.sent for r in traffic.picks(victim.name, killed)), default=killed)
    assert last - killed < METRICS_STALENESS_SECONDS + 0.5, (
        f"the dead engine was picked {last - killed:.2f} s after the kill"
    )
    assert traffic.picks(survivor.name, last, not_ready), "nothing was served meanwhile"
    print(
        f"\nengine killed under traffic: {len(after_kill)} picks of the dead engine, the last "
        f"{last - killed:.2f} s after the kill (staleness bound {METRICS_STALENESS_SECONDS} s; "
        f"NotReady written {not_ready - killed:.1f} s after it); each failed in "
        f"<= {max((r.done - r.sent for r in after_kill), default=0.0):.2f} s; "
        f"{len(results)} requests in all"
    )
