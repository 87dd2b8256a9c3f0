"""LoRA adapters of a routed MStarDeployment on the real control plane, behind the real picker.

Two real engines on their kwok pod addresses (`engine_kubelet.EngineKubelet`: a pod is Ready
only once its engine answers /ready), the operator as a process, the real endpoint picker with
the config the operator rendered (lora-affinity-scorer on `mstar:lora_requests_info`). The
adapters are random PEFT folders of the tiny model made here with `peft`; `spec.adapters` names
them by path, and the operator's adapter sync loads them into every ready engine.

- Affinity: each engine has one slot (`maxLoras: 1`) and holds a different adapter resident;
  concurrent requests for both go through the picker, and each engine's own counters say where
  they were served and how often a slot had to switch.
- Hot load: an adapter added to the live CR is loaded on both running engines (pod UIDs and
  ReplicaSets unchanged, listed in /v1/models, served), and one removed is unloaded.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from built_tools import wait_until
from engine_kubelet import EngineKubelet, gate_pods, ready_gate_policy
from epp_harness import Engine, Gateway, Picker, Traffic, gauge
from lora_adapters import build_adapter
from real_cluster import ControlPlane
from test_cluster import WAIT, apply, pods, wait_ready
from test_epp import MODEL, NAME, install_crds, routed_cr, start_picker

pytestmark = pytest.mark.usefixtures("real_operator")
NAMESPACE = "lora"
RESIDENT = ("sql", "chat")  # one per engine, each engine has one slot
HOT = "math"  # added to the live CR
REQUESTS = 90  # through the picker, about half per adapter


@dataclass
class LoraPool:
    cp: ControlPlane
    doc: dict[str, Any]
    folders: dict[str, Path]
    kubelet: EngineKubelet
    picker: Picker
    gateway: Gateway

    def engines(self) -> list[Engine]:
        return [self.kubelet.engines[n] for n in sorted(self.kubelet.serving())]


def adapter(name: str, folders: dict[str, Path]) -> dict[str, Any]:
    return {"name": name, "source": {"path": str(folders[name])}}


def status_adapters(cp: ControlPlane) -> dict[str, int]:
    cr = cp.get("msd", NAME, NAMESPACE) or {}
    return {a["name"]: a.get("loaded", 0) for a in (cr.get("status") or {}).get("adapters", [])}


def served(engine: Engine) -> dict[str, str | None]:
    """The adapters an engine lists in /v1/models: name -> parent."""
    with urllib.request.urlopen(engine.url + "/v1/models", timeout=5) as resp:
        models = json.load(resp)["data"]
    return {m["id"]: m.get("parent") for m in models if m["id"] != MODEL}


def complete(engine: Engine, model: str) -> str:
    """Greedy text for one prompt: an adapter (random A and B) changes the base's."""
    body = {"model": model, "prompt": "w5 w6 w7", "max_tokens": 6, "temperature": 0}
    request = urllib.request.Request(
        engine.url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as resp:
        return str(json.load(resp)["choices"][0]["text"])


def counters(engine: Engine) -> tuple[float, float]:
    """(requests finished, adapter slot loads) from the engine's own /metrics."""
    m = engine.metrics()
    finished = sum(v for (n, _), v in m.items() if n == "mstar:request_success_total")
    return finished, gauge(m, "mstar:lora_loads_total")


@pytest.fixture(scope="module")
def lora_pool(
    control_plane: ControlPlane, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LoraPool]:
    cp = control_plane
    install_crds(cp)
    cp.kubectl("create", "namespace", NAMESPACE)
    logs = tmp_path_factory.mktemp("lora")
    folders = {
        name: build_adapter(tiny_llama_dir, logs / name, rank=8, seed=seed)
        for seed, name in enumerate((*RESIDENT, HOT), start=1)
    }
    doc = routed_cr()
    doc["spec"]["engine"].update({"maxLoras": 1, "maxLoraRank": 8})
    doc["spec"]["adapters"] = [adapter(name, folders) for name in RESIDENT]
    picker = None
    try:
        gate_pods(cp, NAMESPACE, WAIT)
        with EngineKubelet(cp, NAME, NAMESPACE, tiny_llama_dir, logs) as kubelet:
            apply(cp, doc, NAMESPACE)
            wait_ready(cp, NAME, NAMESPACE, 2)
            picker, bin_dir = start_picker(cp, NAMESPACE, logs)
            wait_until(lambda: gauge(picker.metrics(), "inference_pool_ready_pods") == 2,
                       "the picker to see both pods", WAIT, picker)  # fmt: skip
            yield LoraPool(cp, doc, folders, kubelet, picker, Gateway(bin_dir / "extproc-gateway",
                           picker))  # fmt: skip
            assert not kubelet.errors, kubelet.errors
    finally:
        if picker is not None:
            picker.stop()
        for item in ready_gate_policy(NAMESPACE):
            cp.kubectl("delete", item["kind"], item["metadata"]["name"], check=False)
        cp.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def test_the_operator_loads_spec_adapters_into_every_ready_engine(lora_pool: LoraPool) -> None:
    want = dict.fromkeys(RESIDENT, 2)
    wait_until(lambda: status_adapters(lora_pool.cp) == want, f"status.adapters {want}", WAIT)
    for engine in lora_pool.engines():
        assert served(engine) == dict.fromkeys(RESIDENT, MODEL), engine.name
    config = lora_pool.picker.config_path.read_text()
    assert "lora-affinity-scorer" in config and "mstar:lora_requests_info" in config


def test_requests_for_an_adapter_go_to_the_engine_where_it_is_resident(
    lora_pool: LoraPool,
) -> None:
    """Each engine has one slot holding its own adapter, and no request runs on either before
    the traffic: the picker learns residency from `running_lora_adapters`, which lists an
    idle resident adapter too (the inference extension's "loaded and ready to serve")."""
    pool = lora_pool
    wait_until(lambda: status_adapters(pool.cp) == dict.fromkeys(RESIDENT, 2), "adapters", WAIT)
    engines = pool.engines()
    home = dict(zip(RESIDENT, engines, strict=True))
    for name, engine in home.items():  # one slot each: this makes `name` the resident one
        assert complete(engine, name) != complete(engine, MODEL)
    before = {e.name: counters(e) for e in engines}

    def sender(name: str) -> Traffic:
        def body(worker: int, n: int) -> dict[str, Any]:
            prompt = f"w{5 + worker} w{10 + n % 80} w{20 + n % 50}"
            return {"model": name, "prompt": prompt, "max_tokens": 12}

        return Traffic(pool.gateway, pool.kubelet.name_of, body, threads=3)

    (a, _), (b, _) = home.items()
    time.sleep(0.5)  # the picker scrapes every 50 ms: it has seen the idle engines
    with sender(a) as first, sender(b) as second:
        wait_until(lambda: len(first.results) + len(second.results) >= REQUESTS,
                   f"{REQUESTS} requests", 600)  # fmt: skip
    traffic = {a: first.results, b: second.results}
    results = [*first.results, *second.results]
    after = {e.name: counters(e) for e in engines}
    assert all(r.status == 200 for r in results), [r for r in results if r.status != 200][:3]
    print("\nLoRA affinity through the picker | adapter | resident on | requests | there | share")
    shares = {}
    for name, engine in home.items():
        there = sum(r.engine == engine.name for r in traffic[name])
        shares[name] = there / len(traffic[name])
        print(f"| {name} | {engine.name} | {len(traffic[name])} | {there} | "
              f"{shares[name]:.2f} |")  # fmt: skip
    # Each engine's own counters: every request it finished is one the gateway sent it, and a
    # request served away from its adapter's slot is a slot load.
    loads = {n: after[n][1] - before[n][1] for n in after}
    print(f"slot loads during the run (engines' mstar:lora_loads_total): {loads}")
    for e in engines:
        picked = sum(r.engine == e.name for r in results)
        assert after[e.name][0] - before[e.name][0] == picked, e.name
    assert min(shares.values()) >= 0.9, shares


def test_an_adapter_added_to_the_live_cr_loads_without_a_restart(lora_pool: LoraPool) -> None:
    pool, cp = lora_pool, lora_pool.cp
    wait_until(lambda: status_adapters(cp) == dict.fromkeys(RESIDENT, 2), "adapters", WAIT)
    uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cp, NAME, NAMESPACE)}
    sets = {rs["metadata"]["name"] for rs in cp.items("replicasets", NAMESPACE)}
    # The apiserver's CEL refuses an adapter named like the base model.
    clash = json.loads(json.dumps(pool.doc))
    clash["spec"]["adapters"].append({"name": MODEL, "source": {"path": "/x"}})
    refused = cp.kubectl("apply", "--dry-run=server", "-n", NAMESPACE, "-f", "-",
                         stdin=json.dumps(clash), check=False)  # fmt: skip
    assert refused.returncode != 0 and "base model's name" in refused.stderr, refused.stderr

    pool.doc["spec"]["adapters"].append(adapter(HOT, pool.folders))
    changed = time.monotonic()
    apply(cp, pool.doc, NAMESPACE)
    want = {**dict.fromkeys(RESIDENT, 2), HOT: 2}
    wait_until(lambda: status_adapters(cp) == want, f"status.adapters {want}", WAIT)
    print(f"\n{HOT} loaded on both engines {time.monotonic() - changed:.1f} s after the change")
    for engine in pool.engines():
        assert served(engine)[HOT] == MODEL, engine.name
        assert complete(engine, HOT) != complete(engine, MODEL)
    (routed,) = pool.gateway.send([{"model": HOT, "prompt": "w9 w8", "max_tokens": 4}])
    assert routed["status"] == 200, routed

    pool.doc["spec"]["adapters"] = [a for a in pool.doc["spec"]["adapters"] if a["name"] != "chat"]
    apply(cp, pool.doc, NAMESPACE)
    want = {"sql": 2, HOT: 2}
    wait_until(lambda: status_adapters(cp) == want, f"status.adapters {want}", WAIT)
    for engine in pool.engines():
        assert set(served(engine)) == {"sql", HOT}, engine.name
    # No pod was replaced and no rollout began: same pods, same ReplicaSets, no engine stopped.
    assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods(cp, NAME, NAMESPACE)} == uids
    assert {rs["metadata"]["name"] for rs in cp.items("replicasets", NAMESPACE)} == sets
    assert pool.kubelet.stopped == []
