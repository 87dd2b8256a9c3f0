"""Every Grafana panel's PromQL, evaluated by a real Prometheus scraping a live /metrics endpoint.

TEMPORARY: until the engine server lands, the `metrics_target` fixture serves a stand-in exporter
(prometheus_client) with exactly the metric families the server will export. Set
MSTAR_METRICS_TARGET=host:port to point the test at a running `mstar-engine serve` instead; the
lead will switch the fixture to start the real server.
"""

from __future__ import annotations

import http.server
import json
import math
import os
import random
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from op_harness import ROOT, free_port

from tests.prometheus_helper import prometheus_available, query, run_prometheus, wait_for_series

DASHBOARDS = sorted((ROOT / "charts" / "mstar" / "dashboards").glob("*.json"))
MODEL = "smollm2"

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


class StandInExporter:
    """TEMPORARY stand-in for the engine's /metrics: the agreed families, changing over time."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        labels = ("model_name",)
        self.gauges = {n: Gauge(n, n, labels, registry=self.registry) for n in GAUGES}
        self.counters = {
            n: Counter(n, n, (*labels, *extra), registry=self.registry)
            for n, extra in COUNTERS.items()
        }
        self.histograms = {n: Histogram(n, n, labels, registry=self.registry) for n in HISTOGRAMS}
        self._stop = threading.Event()
        self._rng = random.Random(0)
        self.port = free_port()

    def tick(self) -> None:
        rng = self._rng
        for name, gauge in self.gauges.items():
            gauge.labels(MODEL).set(rng.random() if "perc" in name else rng.randint(0, 8))
        for name, counter in self.counters.items():
            if name == "mstar:admit_failures":
                for reason in ("AllocationFailed", "RequestOffloading", "AdmitRuntimeError"):
                    counter.labels(MODEL, reason, "kv").inc(rng.randint(1, 3))
            elif name == "mstar:request_success":
                for why in ("stop", "length", "abort"):
                    counter.labels(MODEL, why).inc(rng.randint(1, 3))
            else:
                counter.labels(MODEL).inc(rng.randint(1, 50))
        for hist in self.histograms.values():
            for _ in range(5):
                hist.labels(MODEL).observe(rng.expovariate(20.0))

    def __enter__(self) -> str:
        # Always the classic text format, as the engine server must: prometheus_client 0.26's
        # OpenMetrics encoder (what Prometheus asks for first) rewrites "mstar:x" to "mstar_x".
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        registry = self.registry

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = generate_latest(registry)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.tick()
        self.ticker = threading.Thread(target=self._run, daemon=True)
        self.ticker.start()
        return f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.tick()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.ticker.join(5)
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture()
def metrics_target() -> Iterator[str]:
    """host:port serving the engine's metrics (TEMPORARY stand-in unless MSTAR_METRICS_TARGET)."""
    target = os.environ.get("MSTAR_METRICS_TARGET")
    if target:
        yield target
        return
    with StandInExporter() as stand_in:
        yield stand_in


@pytest.mark.skipif(
    not prometheus_available(),
    reason="prometheus is not installed (scripts/install-test-tools.sh installs it)",
)
def test_every_panel_query_evaluates_against_prometheus(metrics_target: str) -> None:
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
                if any(math.isfinite(v) for v in values):
                    break
                if time.monotonic() > deadline:
                    failures[title] = f"no finite value from {promql!r}: {rows}"
                    break
                time.sleep(0.25)
        assert failures == {}
        # The values mean what the panels say: e.g. admit refusals split by reason and resource.
        rows = query(prom, concrete(next(e for _, e in expressions() if "admit_failures" in e)))
        assert {r["metric"]["reason"] for r in rows} == {
            "AllocationFailed",
            "RequestOffloading",
            "AdmitRuntimeError",
        }
        assert all(r["metric"]["resource"] == "kv" for r in rows)


def test_prometheus_helper_reports_promql_errors() -> None:
    if not prometheus_available():
        pytest.skip("prometheus is not installed (scripts/install-test-tools.sh installs it)")
    with run_prometheus(["127.0.0.1:1"]) as prom:
        with pytest.raises(ValueError, match="bad_data"):
            query(prom, "sum(rate(x[5m])")
        assert query(prom, "vector(1)")[0]["value"][1] == "1"
