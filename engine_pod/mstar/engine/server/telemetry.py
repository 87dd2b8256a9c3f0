"""OpenTelemetry traces of served requests: one SERVER span each, phases and engine events.

Configured by the standard `OTEL_*` variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_HEADERS`...) and off, at no cost, when no
endpoint is set. Each app owns its TracerProvider instead of the global one, so several servers
(tests) can live in one process, each exporting to its own receiver.

The engine reports lifecycle times on its monotonic clock and the events it did to a request
(admit refusals, evictions, offloads, reloads, recomputations); this module turns them into
child spans and span events after the fact. It only observes: nothing here steers the engine.

No engine event is ever dropped from a span. A request refused a thousand times would blow
any span event limit, so events are gathered while the request runs and written when it ends:
repeats of one kind (same name, reason, resource, eviction mode, choice) become one event
carrying `mstar.count`, stamped at the first and naming the last (`mstar.last_time_unix_nano`).
When even that exceeds `MAX_SPAN_EVENTS`, kinds are merged across choices, and the span says
so (`mstar.events.capped`). The `mstar.count`s of a span always sum to what `/metrics` counted
for that request (`mstar.events.total` on the span).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mstar.engine.outputs import EngineEvent

DEFAULT_SERVICE_NAME = "mstar-engine"
#: vLLM's span name, so vLLM trace views and queries find ours.
REQUEST_SPAN_NAME = "llm_request"
_PROPAGATOR = TraceContextTextMapPropagator()
#: Span events per request span, set here so `OTEL_SPAN_EVENT_COUNT_LIMIT` cannot silently cut
#: engine events (the SDK drops events past its limit without a word). The SDK default.
MAX_SPAN_EVENTS = 128
#: Event attributes that tell one kind of engine event from another; the rest (pages, message)
#: vary per occurrence and are kept from the first one.
IDENTITY_ATTRIBUTES = ("reason", "resource", "mode")
#: The attributes the server adds to say which choice an event belongs to.
CHOICE_ATTRIBUTES = ("mstar.choice", "mstar.engine_request_id")


#: OpenTelemetry's current GenAI names for attributes the server sets under vLLM's older ones.
#: Both go on the span: vLLM's trace views and saved Jaeger queries read the old names,
#: current OpenTelemetry tooling the new.
CURRENT_GENAI_NAMES = {
    "gen_ai.usage.prompt_tokens": "gen_ai.usage.input_tokens",
    "gen_ai.usage.completion_tokens": "gen_ai.usage.output_tokens",
    "gen_ai.request.id": "gen_ai.response.id",
    "gen_ai.system": "gen_ai.provider.name",
}


def traces_endpoint(env: Mapping[str, str]) -> str | None:
    """The OTLP/HTTP traces URL the standard variables name, or None (tracing off)."""
    url = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    if url:
        return url
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if base:
        return base.rstrip("/") + "/v1/traces"
    return None


def _attr_value(value: Any) -> Any:
    """OTel attributes take str, bool, int, float or homogeneous sequences of them."""
    if isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Sequence) and all(isinstance(v, str | bool | int | float) for v in value):
        return list(value)
    return str(value)


def span_attributes(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as the span takes them (None dropped), each old GenAI name with its new one."""
    out = {k: _attr_value(v) for k, v in attributes.items() if v is not None}
    for old, new in CURRENT_GENAI_NAMES.items():
        if old in out:
            out.setdefault(new, out[old])
    return out


@dataclass
class _Tally:
    """Occurrences of one kind of engine event on one request."""

    name: str
    first_ns: int
    attributes: dict[str, Any]
    count: int = 0
    last_ns: int = 0
    choices: set[Any] = field(default_factory=set)

    def add(self, count: int, last_ns: int, choices: Iterable[Any]) -> None:
        self.count += count
        self.last_ns = max(self.last_ns, last_ns)
        self.choices.update(choices)


def _merge(tallies: Iterable[_Tally], drop: Sequence[str]) -> list[_Tally]:
    """Fold tallies that differ only in the `drop` attributes into one each."""
    merged: dict[tuple[Any, ...], _Tally] = {}
    for t in sorted(tallies, key=lambda t: t.first_ns):
        attrs = {k: v for k, v in t.attributes.items() if k not in drop}
        key = (t.name, *(attrs.get(k) for k in IDENTITY_ATTRIBUTES if k not in drop))
        into = merged.get(key)
        if into is None:
            into = merged[key] = _Tally(t.name, t.first_ns, attrs)
        into.add(t.count, t.last_ns, t.choices)
    return list(merged.values())


class RequestTrace:
    """The SERVER span of one request and the engine events gathered for it until it ends."""

    def __init__(self, span: Span) -> None:
        self.span = span
        self._tallies: dict[tuple[Any, ...], _Tally] = {}
        self.total_events = 0

    def record(self, name: str, time_ns: int, attributes: dict[str, Any]) -> None:
        key = (
            name,
            *(attributes.get(k) for k in IDENTITY_ATTRIBUTES),
            *(attributes.get(k) for k in CHOICE_ATTRIBUTES),
        )
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally(name, time_ns, attributes)
        tally.add(1, time_ns, [attributes.get("mstar.choice")])
        self.total_events += 1

    def write_events(self) -> None:
        """Add the gathered events to the span: one per kind, within `MAX_SPAN_EVENTS`."""
        tallies = list(self._tallies.values())
        capped = len(tallies) > MAX_SPAN_EVENTS
        if capped:  # too many kinds per choice: merge kinds across choices
            tallies = _merge(tallies, CHOICE_ATTRIBUTES)
        if len(tallies) > MAX_SPAN_EVENTS:  # cannot happen with the engine's few kinds
            tallies = _merge(tallies, (*CHOICE_ATTRIBUTES, *IDENTITY_ATTRIBUTES))
        for t in sorted(tallies, key=lambda t: t.first_ns)[:MAX_SPAN_EVENTS]:
            attrs = {**t.attributes, "mstar.count": t.count, "mstar.last_time_unix_nano": t.last_ns}
            if capped:
                attrs["mstar.choices"] = len(t.choices)
            self.span.add_event(t.name, attrs, timestamp=t.first_ns)
        self.span.set_attributes(
            {"mstar.events.total": self.total_events, "mstar.events.capped": capped}
        )
        self._tallies.clear()


class Telemetry:
    """The tracer of one app and helpers that turn engine times and events into spans."""

    def __init__(
        self,
        *,
        service_name: str | None = None,
        endpoint: str | None = None,
        exporter: SpanExporter | None = None,
        batch: bool = True,
    ) -> None:
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self.provider: TracerProvider | None = None
        if exporter is None and endpoint is not None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=endpoint)
        if exporter is None:
            self.tracer: trace.Tracer = trace.NoOpTracer()
            return
        # Resource.create reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES; the sampler
        # default reads OTEL_TRACES_SAMPLER.
        attributes = {SERVICE_NAME: service_name} if service_name else {}
        resource = Resource.create(attributes)
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
        self.provider = TracerProvider(
            resource=resource,
            shutdown_on_exit=False,
            span_limits=SpanLimits(max_events=MAX_SPAN_EVENTS),
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("mstar.engine.server")

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, service_name: str | None = None
    ) -> Telemetry:
        """Tracing per the `OTEL_*` variables of `env` (default: the process environment)."""
        env = os.environ if env is None else env
        if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
            return cls()
        name = service_name or env.get("OTEL_SERVICE_NAME") or None
        return cls(service_name=name, endpoint=traces_endpoint(env))

    @property
    def enabled(self) -> bool:
        return self.provider is not None

    def epoch_ns(self, monotonic: float) -> int:
        """A monotonic time (the engine's clock) as the wall-clock nanoseconds spans use."""
        return int(monotonic * 1e9) + self._offset_ns

    def start_request(
        self,
        headers: Mapping[str, str],
        attributes: Mapping[str, Any],
        start: float,
    ) -> RequestTrace:
        """The SERVER span of one HTTP request, continuing an incoming `traceparent`."""
        parent: Context = _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
        span = self.tracer.start_span(
            REQUEST_SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            attributes=span_attributes(attributes),
            start_time=self.epoch_ns(start),
        )
        return RequestTrace(span)

    def add_events(
        self,
        request_trace: RequestTrace,
        events: Sequence[EngineEvent],
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Gather engine events (admit refusal, eviction, offload, reload...) for the span."""
        if not request_trace.span.is_recording():
            return
        for event in events:
            attrs = {k: _attr_value(v) for k, v in event.attributes.items() if v is not None}
            if extra:
                attrs.update({k: _attr_value(v) for k, v in extra.items()})
            request_trace.record(event.name, self.epoch_ns(event.time), attrs)

    def add_phases(
        self,
        request_trace: RequestTrace,
        *,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Child spans `queue`, `prefill`, `decode` of one engine request, from its times."""
        span = request_trace.span
        if not span.is_recording():
            return
        ctx = trace.set_span_in_context(span)
        attrs = {k: _attr_value(v) for k, v in (attributes or {}).items()}
        phases: list[tuple[str, float, float | None]] = [("queue", arrival, first_scheduled)]
        if first_scheduled is not None:
            phases.append(("prefill", first_scheduled, first_token))
        if first_token is not None:
            phases.append(("decode", first_token, finished))
        for name, begin, end in phases:
            # A phase the request never left (aborted while queued) ends at the finish.
            stop = finished if end is None else end
            child = self.tracer.start_span(
                name, context=ctx, attributes=attrs, start_time=self.epoch_ns(begin)
            )
            child.end(end_time=self.epoch_ns(max(begin, stop)))

    def end_request(
        self,
        request_trace: RequestTrace,
        attributes: Mapping[str, Any],
        end: float,
        error: str | None = None,
    ) -> None:
        span = request_trace.span
        if span.is_recording():
            request_trace.write_events()
        span.set_attributes(span_attributes(attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=self.epoch_ns(end))

    def force_flush(self, timeout_ms: int = 5000) -> bool:
        return self.provider.force_flush(timeout_ms) if self.provider else True

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()
            self.provider = None
            self.tracer = trace.NoOpTracer()
