"""A real Prometheus scraping the real server; PromQL (the dashboards' own panels) over it."""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any

from external_tools import require_tool
from live_server import LiveServer, make_engine

from mstar.engine.outputs import FinishReason
from tests.prometheus_helper import query, run_prometheus, wait_for_series

from .test_load import run_streams

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "charts" / "mstar" / "dashboards").glob("*.json"))
#: Shared by every prompt: two whole 4-token pages the prefix cache can serve.
PREFIX = [20, 21, 22, 23, 24, 25, 26, 27]


def panel_exprs() -> list[str]:
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    for path in DASHBOARDS:
        walk(json.loads(path.read_text())["panels"])
    return exprs


def scalar(base: str, promql: str) -> float:
    rows = query(base, promql)
    return float(rows[0]["value"][1]) if rows else math.nan


def wait_equal(base: str, promql: str, expected: float, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := scalar(base, promql)) != expected:
        if time.monotonic() > deadline:
            raise AssertionError(f"{promql} = {got}, /metrics says {expected}")
        time.sleep(0.25)


def test_prometheus_scrapes_the_server_and_dashboards_evaluate(tiny_chat_dir: Path) -> None:
    require_tool("prometheus")
    engine = make_engine(tiny_chat_dir, num_pages=14, max_num_seqs=8, enable_prefix_caching=True)
    with LiveServer(engine) as live, run_prometheus([f"127.0.0.1:{live.port}"], "1s") as prom:
        wait_for_series(prom, 'mstar:num_requests_running{model_name="tiny"}')
        for round_ in range(3):  # load spread over several scrapes, so rate() has points
            prompts = [[*PREFIX, 3 + round_, 3 + i] for i in range(8)]
            run_streams(live.url, prompts, 16)
            time.sleep(1.2)
        live.wait_metric("mstar:num_requests_running", 0.0)

        # What Prometheus stored is what /metrics says, counter by counter.
        for name in (
            "mstar:generation_tokens_total",
            "mstar:prompt_tokens_total",
            "mstar:prefix_cache_hits_total",
            "mstar:evictions_total",
            "mstar:offloads_total",
        ):
            wait_equal(prom, f'sum({name}{{model_name="tiny"}})', live.metric(name))
        failures = sum(
            v for (n, _), v in live.metrics().items() if n == "mstar:admit_failures_total"
        )
        wait_equal(prom, 'sum(mstar:admit_failures_total{model_name="tiny"})', failures)
        assert scalar(prom, 'sum(mstar:generation_tokens_total{model_name="tiny"})') == 3 * 8 * 16
        assert failures > 0 and live.metric("mstar:prefix_cache_hits_total") > 0
        rows = query(
            prom, 'sum by (finished_reason) (mstar:request_success_total{model_name="tiny"})'
        )
        # Every outcome's series exists from the start.
        assert {r["metric"]["finished_reason"]: float(r["value"][1]) for r in rows} == {
            **{reason.value: 0.0 for reason in FinishReason},
            "length": 24.0,
        }

        # Every dashboard panel parses and evaluates; the traffic panels show real values.
        exprs = panel_exprs()
        assert exprs, "no dashboards found"
        with_data = 0
        for expr in exprs:
            promql = expr.replace("$model_name", "tiny").replace("$__rate_interval", "1m")
            assert "$" not in promql, promql
            rows = query(prom, promql)
            values = [float(r["value"][1]) for r in rows]
            if any(math.isfinite(v) and v > 0 for v in values):
                with_data += 1
            if re.search(r"time_to_first_token|generation_tokens|admit_failures", expr):
                assert any(math.isfinite(v) and v > 0 for v in values), promql
        assert with_data >= len(exprs) // 2
