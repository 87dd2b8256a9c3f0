"""The Gateway API Inference Extension's endpoint picker (EPP v1.5.0), for real.

The operator (a process, as its chart runs it) renders a routed MStarDeployment on the local
control plane; the picker runs with exactly the Deployment args and ConfigMap file the operator
wrote, as the picker's ServiceAccount, watching the real InferencePool; its pods' engines are
real `mstar-engine serve` processes on their kwok pod addresses. Requests reach it through its
ext-proc gRPC stream, as from Envoy, and then go to the engine it picked and complete.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from built_tools import module_version, tool_bin, wait_until
from epp_harness import EPP_VERSION, Engine, Gateway, Picker, gauge
from live_server import BackgroundLoad
from real_cluster import CLUSTER_SH, ControlPlane
from test_cluster import WAIT, apply, load, pods, wait_ready

from mstar.operator import router

NAME = "routed"
MODEL = "smollm2"  # the served name the operator gives the engines (spec.model.name)
PAGE_SIZE = 4  # tokens per KV page of the engines here: 128 pages fill fast
pytestmark = pytest.mark.usefixtures("real_operator")


@dataclass
class Pool:
    engines: list[Engine]
    picker: Picker
    gateway: Gateway

    def other(self, engine: Engine) -> Engine:
        (other,) = [e for e in self.engines if e is not engine]
        return other

    def by_endpoint(self, endpoint: str) -> Engine:
        (engine,) = [e for e in self.engines if e.url == f"http://{endpoint}"]
        return engine


def routed_cr() -> dict[str, Any]:
    """The routed example on two engines small enough for the tiny model: KV fills fast."""
    doc = load("mstardeployment-routed.yaml")
    doc["metadata"]["name"] = NAME
    spec = doc["spec"]
    del spec["autoscaling"]  # the HPA has no metrics API here (test_hpa.py gives it one)
    spec["router"] = {}  # the defaults, without a Gateway
    spec["engine"] = {"numPages": 128, "pageSize": PAGE_SIZE, "maxNumSeqs": 2, "hostOffloadGiB": 0}
    return doc


def install_crds(cp: ControlPlane) -> None:
    """The Inference Extension's CRDs (InferencePool) and the Gateway API's, once established."""
    crds = subprocess.run(
        ["bash", str(CLUSTER_SH), "crds"], capture_output=True, text=True, check=True, timeout=600
    ).stdout.strip()
    cp.kubectl("apply", "--server-side", "-f", crds)
    cp.kubectl("wait", "--for=condition=Established",
               "crd/inferencepools.inference.networking.k8s.io")  # fmt: skip


def start_picker(cp: ControlPlane, namespace: str, logs: Path) -> tuple[Picker, Path]:
    """The picker of the routed CR as its rendered Deployment and ConfigMap run it; its bin dir."""
    bin_dir = tool_bin("epp")
    epp_bin = bin_dir / "epp"
    version = module_version(epp_bin, "sigs.k8s.io/gateway-api-inference-extension")
    print(f"\nendpoint picker: {epp_bin} (gateway-api-inference-extension {version})")
    assert version == EPP_VERSION
    epp = router.epp_name(NAME)
    deployment = wait_until(lambda: cp.get("deployment", epp, namespace), "the EPP", WAIT)
    config_map = cp.get("configmap", epp, namespace)
    assert config_map is not None
    config = config_map["data"][router.EPP_CONFIG_FILE]
    kubeconfig = cp.token_kubeconfig(epp, namespace, logs / "epp.kubeconfig")
    return Picker(epp_bin, deployment, config, kubeconfig, logs), bin_dir


def module_namespace(request: pytest.FixtureRequest) -> str:
    return request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_").replace("_", "-")


@pytest.fixture(scope="module")
def pool(
    control_plane: ControlPlane,
    tiny_llama_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Pool]:
    """Per module that uses it (test_epp_faults.py too), in a namespace of its own."""
    cp = control_plane
    install_crds(cp)
    namespace = module_namespace(request)
    cp.kubectl("create", "namespace", namespace)
    logs = tmp_path_factory.mktemp("epp")
    started: list[Any] = []
    try:
        apply(cp, routed_cr(), namespace)
        wait_ready(cp, NAME, namespace, 2)
        engines = [Engine(p, tiny_llama_dir, logs) for p in pods(cp, NAME, namespace)]
        started += engines
        picker, bin_dir = start_picker(cp, namespace, logs)
        started.append(picker)
        for engine in engines:
            wait_until(engine.ready, f"engine {engine.name} on {engine.ip}", WAIT, engine)
        yield Pool(engines, picker, Gateway(bin_dir / "extproc-gateway", picker))
    finally:
        for process in reversed(started):
            process.stop()
        cp.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_picker_starts_on_the_operators_config_and_reads_mstar_metrics(pool: Pool) -> None:
    """v1.5.0 decodes the rendered config strictly (it refused `data` for `dataLayer`), finds
    both engine pods through the InferencePool under its ServiceAccount's RBAC, and scrapes
    mstar's gauges: its pool averages move with the engines' own /metrics."""
    picker = pool.picker
    ready = wait_until(
        lambda: gauge(picker.metrics(), "inference_pool_ready_pods") == 2,
        "inference_pool_ready_pods 2", WAIT, picker,
    )  # fmt: skip
    assert ready
    log = picker.log()
    assert '"build-ref":"v1.5.0"' in log
    assert "strict decoding error" not in log and "unknown field" not in log
    loaded = pool.engines[0]
    body = {"prompt": "w7 w8 w9", "max_tokens": 200, "ignore_eos": True}
    with BackgroundLoad(loaded.url, 6, lambda _: body):  # 2 running, 4 waiting
        wait_until(lambda: gauge(loaded.metrics(), "mstar:num_requests_waiting") >= 3,
                   "a queue on one engine", WAIT)  # fmt: skip
        # The pool average is refreshed every 5 s from the picker's per-pod scrapes.
        wait_until(
            lambda: gauge(picker.metrics(), "inference_pool_average_queue_size") >= 1.0,
            "the picker to see the queue", 30, picker,
        )  # fmt: skip
        # The engine's KV gauge moves with its first step, a scrape after the queue's: wait
        # for a refresh that saw the running requests' pages.
        wait_until(
            lambda: gauge(picker.metrics(), "inference_pool_average_kv_cache_utilization") > 0.0,
            "the picker to see KV pages in use", 30, picker,
        )  # fmt: skip
        kv = gauge(picker.metrics(), "inference_pool_average_kv_cache_utilization")
        assert 0.0 < kv < 1.0


def test_the_picker_refuses_the_old_data_section(pool: Pool, tmp_path: Path) -> None:
    """What the operator rendered before: the same config with `data` for `dataLayer`. The
    picker exits at once on its strict decoding (the reason for the operator's change)."""
    config = yaml.safe_load(pool.picker.config_path.read_text())
    config["data"] = config.pop("dataLayer")
    old = tmp_path / "old-config.yaml"
    old.write_text(yaml.safe_dump(config))
    argv = [str(old) if a == str(pool.picker.config_path) else a for a in pool.picker.argv]
    assert argv != pool.picker.argv
    proc = subprocess.run(argv, env=pool.picker.env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert re.search(r'unknown field \\?"data\\?"', out), out[-2000:]  # JSON logs escape quotes


def snapshot(engine: Engine) -> tuple[float, float]:
    m = engine.metrics()
    return gauge(m, "mstar:num_requests_waiting"), gauge(m, "mstar:kv_cache_usage_perc")


def picks_under_load(
    pool: Pool, case: str, loaded: Engine, body: dict[str, Any], workers: int, settled: Any
) -> Counter[str]:
    """12 fresh prompts through the picker while `workers` keep `loaded` busy."""
    with BackgroundLoad(loaded.url, workers, lambda _: body):
        wait_until(lambda: settled(loaded), f"{case} on {loaded.name}", WAIT)
        time.sleep(0.3)  # the picker scrapes every 50 ms
        before = {e.name: snapshot(e) for e in pool.engines}
        prompts = [{"model": MODEL, "prompt": f"w{10 + i} w{40 + i} w{70 - i} w5", "max_tokens": 4}
                   for i in range(12)]  # fmt: skip
        results = pool.gateway.send(prompts)
    assert all(r["status"] == 200 for r in results), results
    assert all(json.loads(r["body"])["choices"][0]["text"] for r in results)
    shares = Counter(pool.by_endpoint(r["endpoint"]).name for r in results)
    print(f"\npicks under {case} skew | engine | waiting | KV usage | new requests")
    for e in pool.engines:
        waiting, kv = before[e.name]
        print(f"| {case} | {e.name} | {waiting:.0f} | {kv:.2f} | {shares[e.name]}/{len(results)} |")
    return shares


def test_new_work_goes_away_from_a_deep_queue(pool: Pool) -> None:
    loaded = pool.engines[0]
    body = {"prompt": "w7 w8 w9", "max_tokens": 200, "ignore_eos": True}
    shares = picks_under_load(
        pool, "queue", loaded, body, 8,
        lambda e: snapshot(e)[0] >= 5,
    )  # fmt: skip
    assert shares[pool.other(loaded).name] == 12, shares


def test_new_work_goes_away_from_a_full_kv_cache(pool: Pool) -> None:
    """Two long requests fill most of one engine's pages; no queue on either engine."""
    loaded = pool.engines[1]
    prompt = " ".join(f"w{5 + i % 80}" for i in range(120))
    body = {"prompt": prompt, "max_tokens": 120, "ignore_eos": True}
    shares = picks_under_load(
        pool, "kv", loaded, body, 2,
        lambda e: snapshot(e)[1] >= 0.5,
    )  # fmt: skip
    assert shares[pool.other(loaded).name] >= 11, shares


def test_a_prompt_goes_to_the_engine_holding_its_prefix(pool: Pool) -> None:
    """A long prompt is served once; then, while its engine is the busier one (a long request
    in flight, so the KV scorer prefers the other), a fresh prompt goes to the other engine and
    the same prompt with a new ending goes back to the prefix holder, whose prefix cache hits."""
    shared = " ".join(f"w{5 + (i * 7) % 80}" for i in range(160))
    (first,) = pool.gateway.send([{"model": MODEL, "prompt": shared, "max_tokens": 2}])
    holder = pool.by_endpoint(first["endpoint"])
    # Two workers repeat one greedy request, cut at different lengths so one always runs
    # (between requests the holder's KV usage drops to 0 and the picker may see a tie). Each
    # reuses the cached prompt and decode pages of those before it (one chain: greedy output is
    # the same) and frees its duplicates, so however many run (a fast CPU runs dozens) the load
    # holds under half of the 128 pages and never evicts the prefix's. (A new prompt per
    # busy request evicted them: 0 of 160 prefix tokens hit on a fast machine.)
    busy = {"prompt": "w61" + " w9" * 39, "ignore_eos": True, "temperature": 0}
    with BackgroundLoad(holder.url, 2, lambda w: {**busy, "max_tokens": (100, 60)[w]}):
        wait_until(lambda: snapshot(holder)[1] >= 0.2, "the holder busy", WAIT)
        time.sleep(0.3)
        fresh, again = pool.gateway.send(
            [
                {
                    "model": MODEL,
                    "prompt": " ".join(f"w{90 - i % 80}" for i in range(160)),
                    "max_tokens": 2,
                },
                {"model": MODEL, "prompt": shared + " w11 w12", "max_tokens": 2},
            ]
        )
    assert pool.by_endpoint(fresh["endpoint"]) is pool.other(holder)
    assert pool.by_endpoint(again["endpoint"]) is holder
    assert again["status"] == 200
    pages = json.loads(first["body"])["usage"]["prompt_tokens"] // PAGE_SIZE
    usage = json.loads(again["body"])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == pages * PAGE_SIZE, usage
