"""OpenTelemetry traces of served requests: one SERVER span each, phases and engine events.

Configured by the standard `OTEL_*` variables (`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or
`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_TRACES_SAMPLER[_ARG]`, `OTEL_EXPORTER_OTLP_HEADERS`...) and off, at no cost, when no
endpoint is set. Each app owns its TracerProvider instead of the global one, so several servers
(tests) can live in one process, each exporting to its own receiver.

The engine reports lifecycle times on its monotonic clock and the events it did to a request
(admit refusals, evictions, offloads, reloads, recomputations); this module turns them into
child spans and span events after the fact. It only observes: nothing here steers the engine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from mstar.engine.outputs import EngineEvent

DEFAULT_SERVICE_NAME = "mstar-engine"
#: vLLM's span name, so vLLM trace views and queries find ours.
REQUEST_SPAN_NAME = "llm_request"
_PROPAGATOR = TraceContextTextMapPropagator()


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
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=False)
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
    ) -> Span:
        """The SERVER span of one HTTP request, continuing an incoming `traceparent`."""
        parent: Context = _PROPAGATOR.extract({k.lower(): v for k, v in headers.items()})
        return self.tracer.start_span(
            REQUEST_SPAN_NAME,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={k: _attr_value(v) for k, v in attributes.items() if v is not None},
            start_time=self.epoch_ns(start),
        )

    def add_events(
        self, span: Span, events: Sequence[EngineEvent], extra: Mapping[str, Any] | None = None
    ) -> None:
        """One span event per engine event (admit refusal, eviction, offload, reload...)."""
        if not span.is_recording():
            return
        for event in events:
            attrs = {k: _attr_value(v) for k, v in event.attributes.items() if v is not None}
            if extra:
                attrs.update({k: _attr_value(v) for k, v in extra.items()})
            span.add_event(event.name, attrs, timestamp=self.epoch_ns(event.time))

    def add_phases(
        self,
        span: Span,
        *,
        arrival: float,
        first_scheduled: float | None,
        first_token: float | None,
        finished: float,
        attributes: Mapping[str, Any] | None = None,
    ) -> None:
        """Child spans `queue`, `prefill`, `decode` of one engine request, from its times."""
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
        span: Span,
        attributes: Mapping[str, Any],
        end: float,
        error: str | None = None,
    ) -> None:
        span.set_attributes({k: _attr_value(v) for k, v in attributes.items() if v is not None})
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
