"""Prometheus metrics of one served model, in a registry of its own.

Names mirror vLLM's (`vllm:` -> `mstar:`) where the meaning is the same, so vLLM dashboards
carry over; admission failures, evictions, offloads, reloads, recomputations and host KV usage
are ours. The exposed names (`mstar:admit_failures_total`, ...) are a contract with the Grafana
dashboards: change them only together.

Engine-level counts (tokens, engine events, gauges) are fed from the engine thread after each
step (`on_step`); request-level latencies and outcomes come from the HTTP handler when a
choice ends (`observe_request`), because only the server knows a stop-string or disconnect
ended it. prometheus_client is thread-safe, so both sides write directly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# Text format 0.0.4: what every Prometheus 2.x parses (1.0.0 needs a newer scraper).
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from mstar.engine.outputs import FinishReason, RequestOutput

# vLLM's buckets, so histograms from both engines compare bucket for bucket.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

#: Engine event name -> the counter it increments (admit refusals are labelled separately).
EVENT_COUNTERS = {
    "evicted": "evictions",
    "offloaded": "offloads",
    "reloaded": "reloads",
    "recomputed": "recomputations",
}


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache's fixed shape, exported as `mstar:cache_config_info` (vLLM's
    `vllm:cache_config_info` labels): the endpoint picker reads the page size and count from it
    to size its prefix-affinity blocks."""

    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int = 0


class StatsLike(Protocol):
    kv_usage: float
    host_kv_usage: float
    prefix_queries: int
    prefix_hits: int
    num_running: int
    num_waiting: int


def event_reason(attributes: dict[str, Any]) -> str:
    """The refusal type of an `admit_refused` event (AllocationFailed, RequestOffloading...)."""
    for key in ("reason", "reason_type", "type"):
        if attributes.get(key):
            return str(attributes[key])
    return "unknown"


def event_resource(attributes: dict[str, Any]) -> str:
    """The resource that refused (the `failed_resource` of the FullAdmitOutcome)."""
    for key in ("resource", "failed_resource"):
        if attributes.get(key):
            return str(attributes[key])
    return "unknown"


class ServerMetrics:
    """Every metric of one app; `render()` is the `/metrics` body."""

    def __init__(
        self,
        model_name: str,
        cache: CacheConfig | None = None,
        parameters: tuple[int, int] | None = None,
        kv_groups: tuple[Callable[[], Mapping[str, int]], int] | None = None,
    ) -> None:
        """``parameters``: the model's (held, active per token) counts (an MoE model reads
        only its routed experts per token), exported as ``mstar:model_parameters``;
        ``kv_groups``: (pages requests hold per KV group, bytes of a page), read at each scrape
        as ``mstar:kv_cache_held_pages`` / ``mstar:kv_cache_held_bytes`` by ``group``."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        if kv_groups is not None:
            self.registry.register(_KVGroupsCollector(model_name, *kv_groups))
        labels = ["model_name"]
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg)

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=reg)

        self.running = gauge("mstar:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("mstar:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("mstar:kv_cache_usage_perc", "Device KV pages in use (0-1).")
        self.host_kv_usage = gauge("mstar:host_kv_usage_perc", "Host KV pages in use (0-1).")
        self.prompt_tokens = counter("mstar:prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("mstar:generation_tokens", "Generated tokens.")
        self.prefix_queries = counter(
            "mstar:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "mstar:prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.admit_failures = counter(
            "mstar:admit_failures",
            "Admit refusals by reason type and failing resource.",
            ("reason", "resource"),
        )
        self.event_counters = {
            event: counter(f"mstar:{name}", f"Requests {event} (engine events).")
            for event, name in EVENT_COUNTERS.items()
        }
        self.request_success = counter(
            "mstar:request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = histogram(
            "mstar:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "mstar:inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "mstar:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "mstar:request_queue_time_seconds",
            "Arrival to first scheduled.",
            REQUEST_LATENCY_BUCKETS,
        )
        if cache is not None:
            info = {k: str(v) for k, v in asdict(cache).items()}
            Gauge(
                "mstar:cache_config_info",
                "KV cache shape: tokens per page (block_size) and pages per tier.",
                [*labels, *info],
                registry=reg,
            ).labels(model_name, *info.values()).set(1)
        if parameters is not None:
            params = Gauge(
                "mstar:model_parameters",
                "Model parameters held, and active per token (MoE: the top-k experts).",
                [*labels, "kind"],
                registry=reg,
            )
            for kind, count in zip(("held", "active"), parameters, strict=True):
                params.labels(model_name, kind).set(count)
        # Materialise the unlabelled-by-outcome series at zero so dashboards see them at once.
        for metric in (self.running, self.waiting, self.kv_usage, self.host_kv_usage):
            metric.labels(model_name)
        plain = (self.prompt_tokens, self.generation_tokens, self.prefix_queries, self.prefix_hits)
        for c in plain:
            c.labels(model_name)
        for c in self.event_counters.values():
            c.labels(model_name)
        for reason in FinishReason:
            self.request_success.labels(model_name, reason.value)
        for h in (self.ttft, self.itl, self.e2e, self.queue_time):
            h.labels(model_name)
        # Engine-thread state: cumulative prefix counts already exported, per-request token times.
        self._prefix_seen = (0, 0)
        self._last_token_time: dict[str, float] = {}

    # -- engine thread ---------------------------------------------------------------------------

    def on_step(self, outputs: list[RequestOutput], stats: StatsLike | None, now: float) -> None:
        """Count one step's tokens and events and refresh the gauges."""
        m = self.model_name
        generated = 0
        for out in outputs:
            if out.new_token_ids:
                generated += len(out.new_token_ids)
                last = self._last_token_time.get(out.request_id)
                if last is None:
                    self.prompt_tokens.labels(m).inc(out.num_prompt_tokens)
                else:
                    gap = (now - last) / len(out.new_token_ids)
                    for _ in out.new_token_ids:
                        self.itl.labels(m).observe(gap)
                self._last_token_time[out.request_id] = now
            for event in out.events:
                self.observe_event(event.name, event.attributes)
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
        if generated:
            self.generation_tokens.labels(m).inc(generated)
        if stats is not None:
            self.observe_stats(stats)

    def forget(self, request_id: str) -> None:
        """The server dropped a request (abort): stop tracking its token times."""
        self._last_token_time.pop(request_id, None)

    def observe_event(self, name: str, attributes: dict[str, Any]) -> None:
        m = self.model_name
        if name == "admit_refused":
            reason, resource = event_reason(attributes), event_resource(attributes)
            self.admit_failures.labels(m, reason, resource).inc()
        elif name in self.event_counters:
            self.event_counters[name].labels(m).inc()

    def observe_stats(self, stats: StatsLike) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.host_kv_usage.labels(m).set(stats.host_kv_usage)
        queries, hits = stats.prefix_queries, stats.prefix_hits
        seen_q, seen_h = self._prefix_seen
        if queries > seen_q:
            self.prefix_queries.labels(m).inc(queries - seen_q)
        if hits > seen_h:
            self.prefix_hits.labels(m).inc(hits - seen_h)
        self._prefix_seen = (max(queries, seen_q), max(hits, seen_h))

    # -- handler ---------------------------------------------------------------------------------

    def observe_request(
        self,
        finished_reason: str,
        *,
        arrival: float,
        finished: float,
        first_scheduled: float | None,
        first_token: float | None,
    ) -> None:
        """One choice ended; times are monotonic seconds (the engine's clock)."""
        m = self.model_name
        self.request_success.labels(m, finished_reason).inc()
        self.e2e.labels(m).observe(max(0.0, finished - arrival))
        if first_scheduled is not None:
            self.queue_time.labels(m).observe(max(0.0, first_scheduled - arrival))
        if first_token is not None:
            self.ttft.labels(m).observe(max(0.0, first_token - arrival))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_PLAIN_0_0_4


class _KVGroupsCollector:
    """Pages and bytes the requests hold per KV group (a hybrid model's sliding groups keep
    their window only), read from the KV cache when scraped: a walk over the streams."""

    def __init__(self, model_name: str, held: Callable[[], Mapping[str, int]], page_bytes: int):
        self._model = model_name
        self._held = held
        self._page_bytes = page_bytes

    def describe(self) -> list[GaugeMetricFamily]:
        return list(self._families({}))

    def collect(self) -> Iterator[GaugeMetricFamily]:
        return self._families(self._held())

    def _families(self, held: Mapping[str, int]) -> Iterator[GaugeMetricFamily]:
        labels = ["model_name", "group"]
        pages = GaugeMetricFamily(
            "mstar:kv_cache_held_pages",
            "KV pages requests hold, per KV group.",
            None,
            labels,
        )
        size = GaugeMetricFamily(
            "mstar:kv_cache_held_bytes",
            "KV bytes requests hold, per KV group.",
            None,
            labels,
        )
        for group, n in held.items():
            pages.add_metric([self._model, group], n)
            size.add_metric([self._model, group], n * self._page_bytes)
        yield pages
        yield size
