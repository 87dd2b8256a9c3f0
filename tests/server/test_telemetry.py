"""Telemetry through the real OTLP/HTTP exporter into the test receiver, queried as Jaeger."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.trace import NonRecordingSpan

from mstar.engine.outputs import EngineEvent
from mstar.engine.server.telemetry import REQUEST_SPAN_NAME, Telemetry, traces_endpoint

from .otlp_receiver import OTLPReceiver, log_fields, tag


@pytest.fixture
def receiver() -> Iterator[OTLPReceiver]:
    with OTLPReceiver() as r:
        yield r


def _jaeger(receiver: OTLPReceiver, service: str) -> list[dict[str, Any]]:
    url = f"{receiver.base_url}/api/traces?service={service}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        data: list[dict[str, Any]] = json.loads(resp.read())["data"]
    return data


def _lifecycle(tel: Telemetry, headers: dict[str, str]) -> None:
    """A request's life as the server sees it: arrival, a refusal, an offload, phases, end."""
    t0 = time.monotonic()
    request = tel.start_request(
        headers,
        {
            "gen_ai.request.id": "cmpl-1",
            "gen_ai.request.model": "tiny",
            "gen_ai.request.max_tokens": 8,
            "gen_ai.request.temperature": 0.0,
            "gen_ai.request.top_p": 1.0,
        },
        start=t0,
    )
    tel.add_events(
        request,
        [
            EngineEvent(
                "admit_refused",
                t0 + 0.01,
                {"reason": "AllocationFailed", "resource": "kv", "pages_short": 3, "label": "k"},
            ),
            EngineEvent("offloaded", t0 + 0.02, {"pages": 4}),
            EngineEvent("reloaded", t0 + 0.03, {"pages": 4}),
        ],
        extra={"mstar.choice": 0},
    )
    tel.add_phases(
        request,
        arrival=t0,
        first_scheduled=t0 + 0.04,
        first_token=t0 + 0.05,
        finished=t0 + 0.09,
        attributes={"mstar.choice": 0},
    )
    tel.end_request(
        request,
        {
            "gen_ai.usage.prompt_tokens": 5,
            "gen_ai.usage.completion_tokens": 8,
            "gen_ai.latency.time_to_first_token": 0.05,
        },
        end=t0 + 0.1,
    )


def test_spans_events_and_attributes_reach_the_receiver(receiver: OTLPReceiver) -> None:
    tel = Telemetry(service_name="svc-a", endpoint=receiver.base_url + "/v1/traces")
    assert tel.enabled
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_span = "00f067aa0ba902b7"
    _lifecycle(tel, {"traceparent": f"00-{parent_trace}-{parent_span}-01"})
    assert tel.force_flush()
    tel.shutdown()

    traces = _jaeger(receiver, "svc-a")
    assert len(traces) == 1
    trace = traces[0]
    assert trace["traceID"] == parent_trace  # continued the incoming traceparent
    spans = {s["operationName"]: s for s in trace["spans"]}
    assert set(spans) == {REQUEST_SPAN_NAME, "queue", "prefill", "decode"}
    root = spans[REQUEST_SPAN_NAME]
    assert root["references"] == [
        {"refType": "CHILD_OF", "traceID": parent_trace, "spanID": parent_span}
    ]
    assert tag(root, "span.kind") == "server"
    assert tag(root, "gen_ai.request.model") == "tiny"
    assert tag(root, "gen_ai.request.max_tokens") == 8
    assert tag(root, "gen_ai.usage.completion_tokens") == 8
    assert tag(root, "gen_ai.latency.time_to_first_token") == pytest.approx(0.05)
    assert root["duration"] == pytest.approx(100_000, abs=2)  # microseconds, from engine times

    events = [log_fields(log) for log in root["logs"]]
    assert [e["event"] for e in events] == ["admit_refused", "offloaded", "reloaded"]
    refusal = events[0]
    assert refusal["reason"] == "AllocationFailed"
    assert refusal["resource"] == "kv"
    assert refusal["pages_short"] == 3
    assert refusal["label"] == "k"
    assert refusal["mstar.choice"] == 0
    assert [e["mstar.count"] for e in events] == [1, 1, 1]
    assert tag(root, "mstar.events.total") == 3 and tag(root, "mstar.events.capped") is False
    assert root["logs"][0]["timestamp"] - root["startTime"] == pytest.approx(10_000, abs=2)

    for name, start_us, dur_us in (("queue", 0, 40_000), ("prefill", 40_000, 10_000)):
        child = spans[name]
        assert child["references"][0]["spanID"] == root["spanID"]
        assert child["startTime"] - root["startTime"] == pytest.approx(start_us, abs=2)
        assert child["duration"] == pytest.approx(dur_us, abs=2)
    assert spans["decode"]["duration"] == pytest.approx(40_000, abs=2)


def test_two_apps_export_to_their_own_receivers(receiver: OTLPReceiver) -> None:
    with OTLPReceiver() as other:
        a = Telemetry(service_name="svc-a", endpoint=receiver.base_url + "/v1/traces")
        b = Telemetry(service_name="svc-b", endpoint=other.base_url + "/v1/traces")
        _lifecycle(a, {})
        _lifecycle(b, {})
        a.shutdown()
        b.shutdown()
        assert [len(_jaeger(receiver, s)) for s in ("svc-a", "svc-b")] == [1, 0]
        assert [len(_jaeger(other, s)) for s in ("svc-a", "svc-b")] == [0, 1]
        # Without a parent, each request starts its own trace: the root has no reference.
        spans = _jaeger(receiver, "svc-a")[0]["spans"]
        roots = [s for s in spans if s["operationName"] == REQUEST_SPAN_NAME]
        assert len(roots) == 1 and roots[0]["references"] == []


def test_env_configuration() -> None:
    assert traces_endpoint({}) is None
    assert traces_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318/"}) == (
        "http://h:4318/v1/traces"
    )
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:4318",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:9/x",
    }
    assert traces_endpoint(env) == "http://t:9/x"
    off = Telemetry.from_env({})
    assert not off.enabled
    request = off.start_request({}, {"gen_ai.request.id": "x"}, start=time.monotonic())
    assert isinstance(request.span, NonRecordingSpan)
    assert not Telemetry.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://h:1", "OTEL_SDK_DISABLED": "true"}
    ).enabled


def test_service_name_from_env(receiver: OTLPReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    tel = Telemetry.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url, "OTEL_SERVICE_NAME": "from-env"}
    )
    _lifecycle(tel, {})
    tel.shutdown()
    assert len(_jaeger(receiver, "from-env")) == 1
    default = Telemetry.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.base_url})
    _lifecycle(default, {})
    default.shutdown()
    assert len(_jaeger(receiver, "mstar-engine")) == 1


def test_more_kinds_than_the_limit_merge_across_choices(receiver: OTLPReceiver) -> None:
    """n=200 choices, each refused and evicted: per choice that is 400 kinds, over the limit."""
    tel = Telemetry(service_name="svc-cap", endpoint=receiver.base_url + "/v1/traces")
    t0 = time.monotonic()
    request = tel.start_request({}, {"gen_ai.request.id": "cmpl-n"}, start=t0)
    for choice in range(200):
        refusal = {"reason": "AllocationFailed", "resource": "kv", "pages_short": choice}
        events = [
            EngineEvent("admit_refused", t0 + 0.001 * choice, refusal),
            EngineEvent("admit_refused", t0 + 0.001 * choice, refusal),
            EngineEvent("evicted", t0 + 0.001 * choice, {"resource": "kv", "mode": "offload"}),
        ]
        tel.add_events(request, events, extra={"mstar.choice": choice})
    tel.end_request(request, {}, end=t0 + 1)
    tel.shutdown()

    (trace,) = _jaeger(receiver, "svc-cap")
    (root,) = trace["spans"]
    events = [log_fields(log) for log in root["logs"]]
    assert [(e["event"], e["mstar.count"], e["mstar.choices"]) for e in events] == [
        ("admit_refused", 400, 200),
        ("evicted", 200, 200),
    ]
    assert "mstar.choice" not in events[0] and events[0]["pages_short"] == 0  # the first's
    assert tag(root, "mstar.events.capped") is True
    assert tag(root, "mstar.events.total") == 600
    assert tag(root, "otel.dropped_events_count") == 0
