"""The exposed metric names (the dashboards' contract) and how engine outputs move them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mstar.engine.outputs import EngineEvent, RequestOutput
from mstar.engine.server.metrics import CacheConfig, ServerMetrics

# Exactly the names the Grafana dashboards query.
CONTRACT = {
    "mstar:num_requests_running",
    "mstar:num_requests_waiting",
    "mstar:kv_cache_usage_perc",
    "mstar:host_kv_usage_perc",
    "mstar:prompt_tokens_total",
    "mstar:generation_tokens_total",
    "mstar:prefix_cache_queries_total",
    "mstar:prefix_cache_hits_total",
    "mstar:admit_failures_total",
    "mstar:evictions_total",
    "mstar:offloads_total",
    "mstar:reloads_total",
    "mstar:recomputations_total",
    "mstar:request_success_total",
    "mstar:time_to_first_token_seconds_bucket",
    "mstar:inter_token_latency_seconds_bucket",
    "mstar:e2e_request_latency_seconds_bucket",
    "mstar:request_queue_time_seconds_bucket",
}


@dataclass
class Stats:
    kv_usage: float = 0.0
    host_kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_running: int = 0
    num_waiting: int = 0


def samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.render()[0].decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: ServerMetrics, name: str, **labels: str) -> float:
    """One series' value; KeyError when it is not exported (absent is not zero)."""
    key = (name, tuple(sorted({"model_name": "tiny", **labels}.items())))
    return samples(m)[key]


def test_contract_names_exposed_with_model_label() -> None:
    m = ServerMetrics("tiny")
    m.observe_event("admit_refused", {"reason": "AllocationFailed", "resource": "kv"})
    m.observe_request("stop", arrival=0.0, finished=1.0, first_scheduled=0.1, first_token=0.2)
    names = {name for name, _ in samples(m)}
    assert names >= CONTRACT
    assert all(dict(labels).get("model_name") == "tiny" for _, labels in samples(m))
    assert m.render()[1].startswith("text/plain; version=0.0.4")


def test_cache_config_info_names_the_kv_shape_as_vllm_does() -> None:
    """The picker's cacheInfoSpec reads block_size / num_gpu_blocks labels of an info gauge."""
    m = ServerMetrics("tiny", CacheConfig(block_size=16, num_gpu_blocks=900, num_cpu_blocks=40))
    info = {"block_size": "16", "num_gpu_blocks": "900", "num_cpu_blocks": "40"}
    assert value(m, "mstar:cache_config_info", **info) == 1
    assert "mstar:cache_config_info" not in {name for name, _ in samples(ServerMetrics("tiny"))}


def test_outputs_events_and_stats_move_the_counters() -> None:
    m = ServerMetrics("tiny")
    refused = EngineEvent(
        "admit_refused",
        0.0,
        {"reason": "AllocationFailed", "resource": "kv", "pages_short": 2, "label": "main"},
    )
    step1 = [
        RequestOutput("a", [5], None, False, num_prompt_tokens=7, events=[refused]),
        RequestOutput("b", [], None, False, num_prompt_tokens=3, events=[refused]),
    ]
    m.on_step(step1, Stats(0.5, 0.1, 10, 4, 1, 1), now=1.0)
    step2 = [
        RequestOutput("a", [6, 7], None, False, num_prompt_tokens=7),
        RequestOutput(
            "b",
            [9],
            None,
            False,
            num_prompt_tokens=3,
            events=[
                EngineEvent("evicted", 0.0, {"resource": "kv", "pages": 3, "mode": "offload"}),
                EngineEvent("offloaded", 0.0, {}),
                EngineEvent("reloaded", 0.0, {}),
                EngineEvent("evicted", 0.0, {"mode": "recompute"}),
                EngineEvent("recomputed", 0.0, {}),
            ],
        ),
    ]
    m.on_step(step2, Stats(0.25, 0.0, 16, 4, 2, 0), now=1.5)
    assert value(m, "mstar:prompt_tokens_total") == 10  # each request once, at its first token
    assert value(m, "mstar:generation_tokens_total") == 4
    assert value(m, "mstar:admit_failures_total", reason="AllocationFailed", resource="kv") == 2
    assert value(m, "mstar:evictions_total") == 2
    assert value(m, "mstar:offloads_total") == 1
    assert value(m, "mstar:reloads_total") == 1
    assert value(m, "mstar:recomputations_total") == 1
    assert value(m, "mstar:prefix_cache_queries_total") == 16  # cumulative stats, exported once
    assert value(m, "mstar:prefix_cache_hits_total") == 4
    assert value(m, "mstar:kv_cache_usage_perc") == 0.25
    assert value(m, "mstar:num_requests_running") == 2
    assert value(m, "mstar:num_requests_waiting") == 0
    # "a" made 2 tokens 0.5 s after its first: two gaps of 0.25 s.
    assert value(m, "mstar:inter_token_latency_seconds_count") == 2
    assert value(m, "mstar:inter_token_latency_seconds_sum") == 0.5


def test_request_outcomes() -> None:
    m = ServerMetrics("tiny")
    m.observe_request("stop", arrival=10.0, finished=12.0, first_scheduled=10.5, first_token=11.0)
    m.observe_request("abort", arrival=10.0, finished=10.2, first_scheduled=None, first_token=None)
    assert value(m, "mstar:request_success_total", finished_reason="stop") == 1
    assert value(m, "mstar:request_success_total", finished_reason="abort") == 1
    assert value(m, "mstar:e2e_request_latency_seconds_count") == 2
    assert value(m, "mstar:e2e_request_latency_seconds_sum") == pytest.approx(2.2)
    assert value(m, "mstar:time_to_first_token_seconds_count") == 1
    assert value(m, "mstar:time_to_first_token_seconds_sum") == 1.0
    assert value(m, "mstar:request_queue_time_seconds_sum") == 0.5


def test_registries_are_per_app() -> None:
    a, b = ServerMetrics("tiny"), ServerMetrics("tiny")
    a.observe_event("reloaded", {})
    assert value(a, "mstar:reloads_total") == 1
    assert value(b, "mstar:reloads_total") == 0


def test_outcome_series_exist_before_any_request() -> None:
    """Every finish reason's counter is exported at 0 from the start (dashboards, deltas)."""
    m = ServerMetrics("tiny")
    for reason in ("stop", "length", "abort", "error"):
        assert value(m, "mstar:request_success_total", finished_reason=reason) == 0
    with pytest.raises(KeyError):
        value(m, "mstar:admit_failures_total", reason="AllocationFailed", resource="kv")


def test_model_parameters_held_and_active() -> None:
    m = ServerMetrics("tiny", parameters=(1000, 250))
    assert value(m, "mstar:model_parameters", kind="held") == 1000
    assert value(m, "mstar:model_parameters", kind="active") == 250
    assert "mstar:model_parameters" not in {name for name, _ in samples(ServerMetrics("tiny"))}
