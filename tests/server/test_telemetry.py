"""Telemetry through the real OTLP/HTTP exporter into the real Jaeger, read back through its
query API; the SDK's in-memory exporter where only the SDK side matters."""

from __future__ import annotations

import time

import pytest
from jaeger import Jaeger, log_fields, tag
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan

from mstar.engine.outputs import EngineEvent
from mstar.engine.server.telemetry import REQUEST_SPAN_NAME, Telemetry, traces_endpoint


def _lifecycle(tel: Telemetry, headers: dict[str, str]) -> None:
    """A request's life as the server sees it: arrival, a refusal, an offload, phases, end."""
    t0 = time.monotonic()
    request = tel.start_request(
        headers,
        {
            "gen_ai.request.id": "cmpl-1",
            "gen_ai.system": "mstar",
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


def test_spans_events_and_attributes_reach_jaeger(jaeger: Jaeger) -> None:
    tel = Telemetry(service_name="tel-lifecycle", endpoint=jaeger.otlp_url + "/v1/traces")
    assert tel.enabled
    parent_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_span = "00f067aa0ba902b7"
    _lifecycle(tel, {"traceparent": f"00-{parent_trace}-{parent_span}-01"})
    assert tel.force_flush()
    tel.shutdown()

    (trace,) = jaeger.wait_for("tel-lifecycle", lambda t: len(t) == 1)
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
    # OpenTelemetry's current GenAI names, each beside vLLM's older one.
    assert (
        tag(root, "gen_ai.usage.completion_tokens") == tag(root, "gen_ai.usage.output_tokens") == 8
    )
    assert tag(root, "gen_ai.usage.prompt_tokens") == tag(root, "gen_ai.usage.input_tokens") == 5
    assert tag(root, "gen_ai.request.id") == tag(root, "gen_ai.response.id") == "cmpl-1"
    assert tag(root, "gen_ai.system") == tag(root, "gen_ai.provider.name") == "mstar"
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


def test_two_apps_export_to_their_own_exporters(jaeger: Jaeger) -> None:
    """Each app owns its TracerProvider: one exports to Jaeger, the other to memory."""
    memory = InMemorySpanExporter()
    a = Telemetry(service_name="tel-app-a", endpoint=jaeger.otlp_url + "/v1/traces")
    b = Telemetry(service_name="tel-app-b", exporter=memory, batch=False)
    _lifecycle(a, {})
    _lifecycle(b, {})
    a.shutdown()
    (trace,) = jaeger.wait_for("tel-app-a", lambda t: len(t) == 1)
    assert "tel-app-b" not in jaeger.services()
    assert {p["serviceName"] for p in trace["processes"].values()} == {"tel-app-a"}
    spans = memory.get_finished_spans()
    assert sorted(s.name for s in spans) == sorted(
        [REQUEST_SPAN_NAME, "queue", "prefill", "decode"]
    )
    assert {s.resource.attributes["service.name"] for s in spans} == {"tel-app-b"}
    # Without a parent, each request starts its own trace: the root has no reference.
    roots = [s for s in trace["spans"] if s["operationName"] == REQUEST_SPAN_NAME]
    assert len(roots) == 1 and roots[0]["references"] == []
    b.shutdown()


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


def test_service_name_from_env(jaeger: Jaeger, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    tel = Telemetry.from_env(
        {"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_url, "OTEL_SERVICE_NAME": "tel-from-env"}
    )
    _lifecycle(tel, {})
    tel.shutdown()
    (trace,) = jaeger.wait_for("tel-from-env", lambda t: len(t) == 1)
    (process,) = trace["processes"].values()
    assert {"key": "deployment.environment", "type": "string", "value": "test"} in process["tags"]
    before = len(jaeger.traces("mstar-engine"))
    default = Telemetry.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": jaeger.otlp_url})
    _lifecycle(default, {})
    default.shutdown()
    jaeger.wait_for("mstar-engine", lambda t: len(t) == before + 1)


def test_more_kinds_than_the_limit_merge_across_choices(jaeger: Jaeger) -> None:
    """n=200 choices, each refused and evicted: per choice that is 400 kinds, over the limit."""
    tel = Telemetry(service_name="tel-cap", endpoint=jaeger.otlp_url + "/v1/traces")
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

    (trace,) = jaeger.wait_for("tel-cap", lambda t: len(t) == 1)
    (root,) = trace["spans"]
    events = [log_fields(log) for log in root["logs"]]
    assert [(e["event"], e["mstar.count"], e["mstar.choices"]) for e in events] == [
        ("admit_refused", 400, 200),
        ("evicted", 200, 200),
    ]
    assert "mstar.choice" not in events[0] and events[0]["pages_short"] == 0  # the first's
    assert tag(root, "mstar.events.capped") is True
    assert tag(root, "mstar.events.total") == 600
    (otlp,) = jaeger.otlp_spans(trace["traceID"])
    assert otlp.get("droppedEventsCount", 0) == 0


def test_jaeger_reports_events_the_sdk_dropped(jaeger: Jaeger) -> None:
    """The control for the checks above: a span over its event limit shows it in Jaeger."""
    provider = TracerProvider(
        resource=Resource({"service.name": "tel-control"}), span_limits=SpanLimits(max_events=1)
    )
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=jaeger.otlp_url + "/v1/traces"))
    )
    span = provider.get_tracer("control").start_span("over-the-limit")
    for name in ("a", "b", "c"):
        span.add_event(name)
    span.end()
    provider.shutdown()
    (trace,) = jaeger.wait_for("tel-control", lambda t: len(t) == 1)
    (otlp,) = jaeger.otlp_spans(trace["traceID"])
    assert otlp["droppedEventsCount"] == 2
