"""Every Grafana panel's PromQL, evaluated by a real Prometheus scraping a live engine server
(the real `mstar-engine` app on a tiny model) under load: each query must show the load, that
is a value above 0 (a panel stuck at 0, or returning nothing, fails)."""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from external_tools import require_tool
from live_server import BackgroundLoad, LiveServer, make_engine
from op_harness import ROOT

from mstar.engine.server.telemetry import CURRENT_GENAI_NAMES
from tests.prometheus_helper import query, run_prometheus, wait_for_series

DASHBOARDS = sorted((ROOT / "charts" / "mstar" / "dashboards").glob("*.json"))

# The contract with the engine server: family -> type (every one labelled model_name).
GAUGES = (
    "mstar:num_requests_running",
    "mstar:num_requests_waiting",
    "mstar:kv_cache_usage_perc",
    "mstar:host_kv_usage_perc",
)
COUNTERS = {  # name without _total -> extra labels
    "mstar:prompt_tokens": (),
    "mstar:generation_tokens": (),
    "mstar:prefix_cache_queries": (),
    "mstar:prefix_cache_hits": (),
    "mstar:admit_failures": ("reason", "resource"),
    "mstar:evictions": (),
    "mstar:offloads": (),
    "mstar:reloads": (),
    "mstar:recomputations": (),
    "mstar:request_success": ("finished_reason",),
}
HISTOGRAMS = (
    "mstar:time_to_first_token_seconds",
    "mstar:inter_token_latency_seconds",
    "mstar:e2e_request_latency_seconds",
    "mstar:request_queue_time_seconds",
)
EXPORTED = {
    *GAUGES,
    *(f"{name}_total" for name in COUNTERS),
    *(f"{name}_{suffix}" for name in HISTOGRAMS for suffix in ("bucket", "sum", "count")),
}


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def expressions() -> list[tuple[str, str]]:
    out = []
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            for target in panel.get("targets", []):
                out.append((f"{path.stem}: {panel['title']} [{target['refId']}]", target["expr"]))
    return out


def concrete(expr: str) -> str:
    """Grafana variables -> values Prometheus accepts (all models, a short rate window)."""
    return expr.replace("$model_name", ".*").replace("$__rate_interval", "15s")


def test_dashboards_use_only_exported_metrics_and_cover_the_brief() -> None:
    exprs = expressions()
    assert exprs
    used = {m for _, e in exprs for m in re.findall(r"mstar:[a-z0-9_:]+", e)}
    assert used <= EXPORTED, f"not exported by the engine: {sorted(used - EXPORTED)}"
    for needed in (
        "mstar:admit_failures_total",
        "mstar:evictions_total",
        "mstar:offloads_total",
        "mstar:reloads_total",
        "mstar:kv_cache_usage_perc",
        "mstar:host_kv_usage_perc",
        "mstar:num_requests_running",
        "mstar:num_requests_waiting",
        "mstar:time_to_first_token_seconds_bucket",
        "mstar:inter_token_latency_seconds_bucket",
        "mstar:prompt_tokens_total",
        "mstar:generation_tokens_total",
    ):
        assert needed in used, f"no panel shows {needed}"
    admit = [e for _, e in exprs if "admit_failures_total" in e]
    assert any("by (reason, resource)" in e for e in admit)
    percentiles = " ".join(e for _, e in exprs if "histogram_quantile" in e)
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, " in percentiles
    texts = [
        p["options"]["content"]
        for path in DASHBOARDS
        for p in panels(json.loads(path.read_text()))
        if p["type"] == "text"
    ]
    assert any("${jaeger_url}/trace/${trace_id}" in t for t in texts), "no Jaeger trace link"
    # The span attributes the trace panel names are the ones the server emits.
    trace_text = " ".join(t for t in texts if "${jaeger_url}" in t)
    for name in CURRENT_GENAI_NAMES.values():
        assert name in trace_text, name


def dashboard_load(url: str) -> BackgroundLoad:
    """Streams of completions against the live server until stopped, so every panel has data.

    Prompts share a page-aligned prefix (prefix-cache hits) and the pool is tiny, so admission
    refuses, victims are offloaded, reloaded and (host pool full) recomputed all along.
    """
    rngs = [random.Random(worker) for worker in range(6)]

    def body(worker: int) -> dict[str, Any]:
        rng = rngs[worker]
        prompt = [20, 21, 22, 23, 24, 25, 26, 27, *(rng.randrange(3, 90) for _ in range(6))]
        return {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}

    return BackgroundLoad(url, len(rngs), body, timeout=60)


@pytest.fixture()
def metrics_target(tiny_llama_dir: Path) -> Iterator[str]:
    """host:port of a real engine server (tiny model) under continuous load."""
    require_tool("prometheus")
    engine = make_engine(
        tiny_llama_dir,
        num_pages=14,
        max_num_seqs=6,
        host_offload_gb=8 * 2048 / 2**30,
        enable_prefix_caching=True,
    )
    with LiveServer(engine) as live, dashboard_load(live.url):
        yield f"127.0.0.1:{live.port}"


def test_every_panel_shows_the_load(metrics_target: str) -> None:
    with run_prometheus([metrics_target], scrape_interval="1s") as prom:
        # Rates and quantiles need two samples inside the window: wait for the slowest kind.
        wait_for_series(prom, concrete("rate(mstar:evictions_total[$__rate_interval])"))
        failures: dict[str, str] = {}
        for title, expr in expressions():
            promql = concrete(expr)
            deadline = time.monotonic() + 20
            while True:
                try:
                    rows = query(prom, promql)
                except ValueError as exc:  # a PromQL error never fixes itself
                    failures[title] = str(exc)
                    break
                values = [float(r["value"][1]) for r in rows]
                # The load runs, refuses, evicts, offloads, reloads, recomputes and hits the
                # prefix cache all along, and keeps requests waiting: every panel moves.
                if any(math.isfinite(v) and v > 0 for v in values):
                    break
                if time.monotonic() > deadline:
                    failures[title] = f"never above 0: {promql!r} = {rows}"
                    break
                time.sleep(0.25)
        assert failures == {}
        # The values mean what the panels say: e.g. admit refusals split by reason and resource.
        rows = query(prom, concrete(next(e for _, e in expressions() if "admit_failures" in e)))
        assert "AllocationFailed" in {r["metric"]["reason"] for r in rows}
        assert all(r["metric"]["resource"] == "kv" for r in rows)


def test_prometheus_helper_reports_promql_errors() -> None:
    require_tool("prometheus")
    with run_prometheus(["127.0.0.1:1"]) as prom:
        with pytest.raises(ValueError, match="bad_data"):
            query(prom, "sum(rate(x[5m])")
        assert query(prom, "vector(1)")[0]["value"][1] == "1"
