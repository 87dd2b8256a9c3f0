"""A small OTLP/HTTP trace receiver answering Jaeger-shaped queries, for tests.

No Jaeger binary can be installed here, so tests send spans through the real OTLP/HTTP
exporter to this receiver: `POST /v1/traces` decodes `ExportTraceServiceRequest` protobufs
(gzip or plain), and `GET /api/traces?service=NAME[&operation=OP][&limit=N]` and
`GET /api/services` answer in Jaeger's query-API JSON shape, so assertions read like queries
against a real Jaeger. It runs on its own thread and event loop, so sync tests can use it.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
from collections import defaultdict
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

_KIND = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _tag(kv: KeyValue) -> dict[str, Any]:
    value = _value(kv.value)
    kind = {bool: "bool", int: "int64", float: "float64", str: "string"}.get(type(value), "string")
    return {"key": kv.key, "type": kind, "value": value}


class OTLPReceiver:
    """Collects spans; `base_url` is what `OTEL_EXPORTER_OTLP_ENDPOINT` should point at."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        # trace id (hex) -> list of (service name, jaeger span dict)
        self._traces: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        self._lock = threading.Lock()
        self.requests = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- ingest ----------------------------------------------------------------------------------

    async def _export(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        message = ExportTraceServiceRequest()
        message.ParseFromString(body)
        with self._lock:
            self.requests += 1
            for rs in message.resource_spans:
                resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                service = str(resource.get("service.name", "unknown"))
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        trace_id = span.trace_id.hex()
                        self._traces[trace_id].append((service, self._jaeger_span(span)))
        reply = ExportTraceServiceResponse().SerializeToString()
        return web.Response(body=reply, content_type="application/x-protobuf")

    @staticmethod
    def _jaeger_span(span: Any) -> dict[str, Any]:
        trace_id = span.trace_id.hex()
        refs = []
        if span.parent_span_id:
            refs.append(
                {"refType": "CHILD_OF", "traceID": trace_id, "spanID": span.parent_span_id.hex()}
            )
        tags = [_tag(kv) for kv in span.attributes]
        tags.append({"key": "span.kind", "type": "string", "value": _KIND.get(span.kind, "")})
        # What the SDK dropped past its limits (OTLP carries the counts; zero is reported too).
        dropped = span.dropped_events_count
        tags.append({"key": "otel.dropped_events_count", "type": "int64", "value": dropped})
        if span.status.code == 2:
            tags.append({"key": "error", "type": "bool", "value": True})
            tags.append(
                {"key": "otel.status_description", "type": "string", "value": span.status.message}
            )
        logs = [
            {
                "timestamp": ev.time_unix_nano // 1000,
                "fields": [{"key": "event", "type": "string", "value": ev.name}]
                + [_tag(kv) for kv in ev.attributes],
            }
            for ev in span.events
        ]
        return {
            "traceID": trace_id,
            "spanID": span.span_id.hex(),
            "operationName": span.name,
            "references": refs,
            "startTime": span.start_time_unix_nano // 1000,
            "duration": (span.end_time_unix_nano - span.start_time_unix_nano) // 1000,
            "tags": tags,
            "logs": logs,
        }

    # -- query -----------------------------------------------------------------------------------

    def query(
        self, service: str, operation: str | None = None, limit: int = 0
    ) -> list[dict[str, Any]]:
        """Jaeger's `/api/traces` `data` list: traces with a span of `service` (and `operation`)."""
        out: list[dict[str, Any]] = []
        with self._lock:
            items = list(self._traces.items())
        for trace_id, entries in items:
            if not any(
                svc == service and (operation is None or s["operationName"] == operation)
                for svc, s in entries
            ):
                continue
            services = sorted({svc for svc, _ in entries})
            pid = {svc: f"p{i + 1}" for i, svc in enumerate(services)}
            spans = [dict(s, processID=pid[svc]) for svc, s in entries]
            out.append(
                {
                    "traceID": trace_id,
                    "spans": spans,
                    "processes": {p: {"serviceName": svc, "tags": []} for svc, p in pid.items()},
                }
            )
        out.sort(key=lambda t: min(s["startTime"] for s in t["spans"]), reverse=True)
        return out[:limit] if limit else out

    async def _api_traces(self, request: web.Request) -> web.Response:
        service = request.query.get("service")
        if not service:
            return web.json_response(
                {"data": None, "errors": [{"code": 400, "msg": "parameter 'service' is required"}]},
                status=400,
            )
        limit = int(request.query.get("limit", "0") or 0)
        data = self.query(service, request.query.get("operation"), limit)
        return web.json_response({"data": data, "total": len(data), "errors": None})

    async def _api_services(self, request: web.Request) -> web.Response:
        with self._lock:
            services = sorted({svc for e in self._traces.values() for svc, _ in e})
        return web.json_response({"data": services, "total": len(services), "errors": None})

    def wait_for(self, service: str, predicate: Any, timeout: float = 10.0) -> list[dict[str, Any]]:
        """Poll until `predicate(traces)` holds; returns the traces (raises on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            traces = self.query(service)
            if predicate(traces):
                return traces
            if time.monotonic() > deadline:
                raise AssertionError(f"traces of {service!r} never matched: {len(traces)} traces")
            time.sleep(0.05)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> OTLPReceiver:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_post("/v1/traces", self._export)
            app.router.add_get("/api/traces", self._api_traces)
            app.router.add_get("/api/services", self._api_services)
            runner = web.AppRunner(app, access_log=None)
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self.host, 0)
            loop.run_until_complete(site.start())
            self._runner = runner
            server = site._server
            assert server is not None
            self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
            ready.set()
            loop.run_forever()
            loop.run_until_complete(runner.cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name="otlp-receiver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("OTLP receiver did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self) -> OTLPReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def tag(span: dict[str, Any], key: str) -> Any:
    """A Jaeger span's tag value by key (KeyError when absent)."""
    for t in span["tags"]:
        if t["key"] == key:
            return t["value"]
    raise KeyError(key)


def log_fields(log: dict[str, Any]) -> dict[str, Any]:
    return {f["key"]: f["value"] for f in log["fields"]}
