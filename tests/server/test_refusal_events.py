"""One request refused hundreds of times: its span still accounts for every refusal.

The SDK keeps at most 128 events per span and drops the rest without a word; the server folds
repeated engine events into counted ones instead, so the span's counts equal what `/metrics`
counted. The refusals come from a test resource that answers, alternately, `RequestOffloading`
and a reason of its own (both: park the request, retry next step, evict nothing), so no
eviction internals are involved.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jaeger import Jaeger, log_fields, tag
from live_server import LiveServer, make_engine

from mstar.engine.resources.base import Resource
from mstar.engine.resources.step import AdmitOutcome, RequestOffloading, ResourceStep, StepContext
from mstar.engine.server.state import STATE
from mstar.engine.server.telemetry import MAX_SPAN_EVENTS, REQUEST_SPAN_NAME, Telemetry

from .test_openai_e2e import raw

REFUSALS = 250
GATED = "rope"


@dataclass
class SlotPoolExhausted:
    """A refusal reason that is neither allocation nor offloading: the scheduler pushes back."""

    message: str


class RefuseFirstAdmits(Resource):
    """Stands in for resource `inner`: refuses the first `times` admits of the first request it
    is given with `RequestOffloading`, and otherwise is `inner` (every call forwarded)."""

    def __init__(self, inner: Resource, times: int) -> None:
        self.inner = inner
        self.left = times
        self.target: str | None = None
        self.supports_preplan = inner.supports_preplan
        self.supports_eviction = inner.supports_eviction

    def ingest_request(self, request_id: str, overrides: Any | None = None) -> None:
        self.target = self.target or request_id
        self.inner.ingest_request(request_id, overrides)

    def admit(self, step: ResourceStep, ctx: StepContext) -> AdmitOutcome:
        if self.left > 0 and self.target in ctx.request_ids:
            self.left -= 1
            reason: Any = (
                RequestOffloading("held by the test", label="test", request_id=self.target)
                if self.left % 2
                else SlotPoolExhausted("no slot for the test")
            )
            return AdmitOutcome(False, False, reason)
        return self.inner.admit(step, ctx)


def _forward(name: str) -> Any:
    def method(self: RefuseFirstAdmits, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    return method


for _name, _value in vars(Resource).items():
    if callable(_value) and not _name.startswith("_") and _name not in vars(RefuseFirstAdmits):
        setattr(RefuseFirstAdmits, _name, _forward(_name))


def install_refusals(engine: Any, times: int) -> RefuseFirstAdmits:
    """The one place this test reaches into the engine: its `StepRunner`, rebuilt from its dict
    of resources with `GATED` wrapped."""
    from mstar.engine.resources.runner import StepRunner

    gate = RefuseFirstAdmits(engine.runner.resources[GATED], times)
    runner = StepRunner({**engine.runner.resources, GATED: gate})
    engine.runner = engine.scheduler.runner = engine.model_runner.runner = runner
    return gate


def test_hundreds_of_refusals_all_reach_the_span(
    tiny_chat_dir: Path, jaeger: Jaeger, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The limit is set in code: not even OTEL_SPAN_EVENT_COUNT_LIMIT=1 cuts the (two) events.
    monkeypatch.setenv("OTEL_SPAN_EVENT_COUNT_LIMIT", "1")
    engine = make_engine(tiny_chat_dir)
    gate = install_refusals(engine, REFUSALS)
    telemetry = Telemetry(service_name="refused", endpoint=jaeger.otlp_url + "/v1/traces")
    with LiveServer(engine, telemetry=telemetry) as live:
        prompt = {"prompt": "w7 w8 w9", "max_tokens": 4, "ignore_eos": True}
        status, body, _ = raw(live, "/v1/completions", prompt)
        assert status == 200 and body["usage"]["completion_tokens"] == 4
        assert gate.left == 0
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)
        refused = {
            reason: live.metric("mstar:admit_failures_total", reason=reason, resource=GATED)
            for reason in ("RequestOffloading", "SlotPoolExhausted")
        }
        # Each refusal parks the request for one step (nothing is evicted or reloaded).
        assert refused == {"RequestOffloading": REFUSALS / 2, "SlotPoolExhausted": REFUSALS / 2}
        assert live.metric("mstar:reloads_total") == live.metric("mstar:evictions_total") == 0
        assert live.app[STATE].telemetry.force_flush()
        (trace,) = jaeger.wait_for("refused", lambda t: len(t) == 1)

    (root,) = [s for s in trace["spans"] if s["operationName"] == REQUEST_SPAN_NAME]
    events = [{**log_fields(log), "at_us": log["timestamp"]} for log in root["logs"]]
    counts: dict[str, int] = {}
    for e in events:
        assert e["event"] == "admit_refused" and e["resource"] == GATED
        assert e["mstar.choice"] == 0
        # The refusing stream: RequestOffloading names one too (SlotPoolExhausted has none).
        assert e.get("label") == ("test" if e["reason"] == "RequestOffloading" else None)
        # first .. last; Jaeger's JSON gives int64s past 2**53 as strings (JavaScript's limit)
        assert int(e["mstar.last_time_unix_nano"]) > e["at_us"] * 1000
        counts[e["reason"]] = counts.get(e["reason"], 0) + e["mstar.count"]
    assert counts == refused
    (otlp_root,) = [
        s for s in jaeger.otlp_spans(trace["traceID"]) if s["name"] == REQUEST_SPAN_NAME
    ]
    assert otlp_root.get("droppedEventsCount", 0) == 0
    assert tag(root, "mstar.events.total") == REFUSALS
    assert tag(root, "mstar.events.capped") is False
    assert len(events) == 2 <= MAX_SPAN_EVENTS
