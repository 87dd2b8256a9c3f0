"""The real Jaeger (v1.75.0, `scripts/cluster.sh build-tools jaeger`) for the trace tests.

In-memory storage, an OTLP/HTTP receiver and the query API, each on a free loopback port (the
config below; nothing else is opened). Tests point the engine's real OTLP exporter at
`otlp_url` and read traces back as a Jaeger user does, through `/api/traces`.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from built_tools import Process, free_port, module_version, tool_bin, wait_until

MODULE = "github.com/jaegertracing/jaeger"

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics: {{level: none}}
    logs: {{level: warn}}
extensions:
  jaeger_storage:
    backends:
      memstore: {{memory: {{max_traces: 100000}}}}
  jaeger_query:
    storage: {{traces: memstore}}
    http: {{endpoint: "127.0.0.1:{query}"}}
    grpc: {{endpoint: "127.0.0.1:{query_grpc}"}}
receivers:
  otlp:
    protocols:
      http: {{endpoint: "127.0.0.1:{otlp}"}}
exporters:
  jaeger_storage_exporter: {{trace_storage: memstore}}
"""


class Jaeger(Process):
    """One Jaeger process; `traces(service)` is its query API's answer."""

    def __init__(self, folder: Path) -> None:
        self.binary = tool_bin("jaeger") / "jaeger"
        self.version = module_version(self.binary, MODULE)
        self.otlp_port, self.query_port = free_port(), free_port()
        config = folder / "jaeger.yaml"
        config.write_text(
            CONFIG.format(otlp=self.otlp_port, query=self.query_port, query_grpc=free_port())
        )
        super().__init__([str(self.binary), "--config", str(config)], folder / "jaeger.log")

    def wait_ready(self) -> None:
        wait_until(lambda: self._get("/api/services"), "Jaeger's query API", 60, self)
        # Accepting OTLP too: an empty export answers 200.
        wait_until(self._otlp_ready, "Jaeger's OTLP receiver", 30, self)

    @property
    def otlp_url(self) -> str:
        """What `OTEL_EXPORTER_OTLP_ENDPOINT` should be."""
        return f"http://127.0.0.1:{self.otlp_port}"

    def _otlp_ready(self) -> bool:
        req = urllib.request.Request(
            self.otlp_url + "/v1/traces", b"{}", {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status == 200

    def _get(self, path: str, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.query_port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read())

    def services(self) -> list[str]:
        return list(self._get("/api/services")["data"] or [])

    def traces(self, service: str, **params: Any) -> list[dict[str, Any]]:
        """Traces with a span of `service` (Jaeger's JSON: spans, tags, logs, references)."""
        if service not in self.services():
            return []
        params.setdefault("limit", 1000)
        return list(self._get("/api/traces", service=service, **params)["data"] or [])

    def otlp_spans(self, trace_id: str) -> list[dict[str, Any]]:
        """One trace as OTLP JSON spans (API v3): what the v1 JSON leaves out, such as
        `droppedEventsCount` (present when non-zero)."""
        result = self._get(f"/api/v3/traces/{trace_id}")["result"]
        return [
            span
            for resource in result["resourceSpans"]
            for scope in resource["scopeSpans"]
            for span in scope["spans"]
        ]

    def wait_for(
        self,
        service: str,
        predicate: Callable[[list[dict[str, Any]]], bool],
        timeout: float = 15.0,
    ) -> list[dict[str, Any]]:
        """Poll until `predicate(traces)` holds; the traces (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            traces = self.traces(service)
            if predicate(traces):
                return traces
            if time.monotonic() > deadline:
                raise AssertionError(f"Jaeger has {len(traces)} traces of {service!r}")
            time.sleep(0.2)


def tag(span: dict[str, Any], key: str) -> Any:
    """A Jaeger span's tag value by key (KeyError when absent)."""
    for t in span["tags"]:
        if t["key"] == key:
            return t["value"]
    raise KeyError(key)


def log_fields(log: dict[str, Any]) -> dict[str, Any]:
    return {f["key"]: f["value"] for f in log["fields"]}
