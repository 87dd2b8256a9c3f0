"""A rollout of a routed 2-replica MStarDeployment under continuous streaming traffic through the
real endpoint picker: every request finishes (the fault suite's rollout case, issue 50).

Readiness is honest here: every pod of the namespace is gated (`engine_kubelet.READY_GATE`), so
kwok marks it Ready only once the real engine on its address answers /ready, and a deleted
pod's engine runs the pod's preStop hook, then gets SIGTERM and drains, as on a node. The CR's
spec changes (maxNumSeqs), the operator rolls the Deployment (maxSurge 1, maxUnavailable 0),
and streams keep flowing through the picker's ext-proc stream the whole time.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from built_tools import wait_until
from engine_kubelet import EngineKubelet, gate_pods, ready_gate_policy
from epp_harness import Gateway, Routed, Traffic, gauge
from real_cluster import ControlPlane
from test_cluster import WAIT, apply, wait_ready
from test_epp import MODEL, NAME, install_crds, routed_cr, start_picker

pytestmark = pytest.mark.usefixtures("real_operator")
NAMESPACE = "epp-rollout"


def failure(r: Routed) -> str:
    """Why a streamed request did not finish cleanly ('' when it did)."""
    if r.error or r.status != 200:
        return f"status {r.status} {r.error}"
    events = [line[6:] for line in r.body.splitlines() if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "no [DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return "an error event"
    if not any(c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")):
        return "no finish_reason"
    return ""


def test_a_rollout_under_streaming_traffic_loses_no_request(
    control_plane: ControlPlane, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    cp = control_plane
    install_crds(cp)
    cp.kubectl("create", "namespace", NAMESPACE)
    doc = routed_cr()
    doc["spec"]["drain"] = {"quietSeconds": 2, "preStopTimeoutSeconds": 20}
    picker = None
    try:
        gate_pods(cp, NAMESPACE, WAIT)
        with EngineKubelet(cp, NAME, NAMESPACE, tiny_llama_dir, tmp_path) as kubelet:
            apply(cp, doc, NAMESPACE)
            wait_ready(cp, NAME, NAMESPACE, 2)
            before = set(kubelet.serving())
            assert len(before) == 2, kubelet.errors
            picker, bin_dir = start_picker(cp, NAMESPACE, tmp_path)
            wait_until(lambda: gauge(picker.metrics(), "inference_pool_ready_pods") == 2,
                       "the picker to see both pods", WAIT, picker)  # fmt: skip
            gateway = Gateway(bin_dir / "extproc-gateway", picker)

            def body(worker: int, n: int) -> dict[str, Any]:
                prompt = f"w{5 + worker} w{10 + n % 80}"
                return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "stream": True}

            with Traffic(gateway, kubelet.name_of, body, threads=3) as traffic:
                traffic.wait_first()
                time.sleep(2.0)
                started = time.monotonic()
                doc["spec"]["engine"]["maxNumSeqs"] = 3  # new engine args: a new ReplicaSet
                apply(cp, doc, NAMESPACE)
                wait_ready(cp, NAME, NAMESPACE, 2)
                wait_until(lambda: len(kubelet.stopped) == 2 and not set(kubelet.serving())
                           & before, "both old engines to exit", WAIT)  # fmt: skip
                rolled = time.monotonic() - started
                time.sleep(2.0)  # traffic on the new pods alone
            after = set(kubelet.serving())
            assert not kubelet.errors, kubelet.errors
    finally:
        if picker is not None:
            picker.stop()
        for item in ready_gate_policy(NAMESPACE):
            cp.kubectl("delete", item["kind"], item["metadata"]["name"], check=False)
        cp.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)

    results = traffic.results
    failed = [(r.engine, failure(r)) for r in results if failure(r)]
    during = [r for r in results if started <= r.sent <= started + rolled]
    by_engine = Counter(r.engine for r in results)
    old = "; ".join(
        f"{s.name} exit {s.exit_code} {s.seconds:.1f} s after its deletion ({s.prestop})"
        for s in kubelet.stopped
    )
    print(
        f"\nrollout under streaming traffic: {len(results)} requests ({len(during)} during the "
        f"{rolled:.1f} s rollout), {len(results) - len(failed)} finished, {len(failed)} failed; "
        f"by pod {dict(by_engine)}; old engines: {old}"
    )
    assert failed == [], failed
    assert len(after) == 2 and not after & before, (before, after)
    # Traffic went through the rollout and onto the new pods; the old engines drained and
    # exited 0; the longest request did not hang.
    assert during and {r.engine for r in during} & before
    assert {r.engine for r in results if r.sent > started + rolled} <= after
    assert all(s.exit_code == 0 for s in kubelet.stopped), kubelet.stopped
    assert max(r.done - r.sent for r in results) < 30
