"""LoRA serving on the HTTP side: vLLM's admin routes, the adapters in `/v1/models`, the
``model`` field naming an adapter, and the adapter metrics the endpoint picker reads.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: check the PEFT folder and
  serve it (200); a bad folder, a rank over ``--max-lora-rank`` or a taken name is a 400
  naming the parameter. The weights load into a slot when a request first asks for them.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: stop serving it (200; 404 if unknown);
  running requests finish with it.
- ``vllm:lora_requests_info`` and ``mstar:lora_requests_info``: vLLM's gauge, labels
  ``running_lora_adapters`` / ``waiting_lora_adapters`` (comma-joined) and ``max_lora``, value
  the time of the scrape (the picker reads the newest series); counters of adapter loads,
  evictions, failed loads, refusals by reason, and requests per adapter
  (``mstar:lora_requests_total{adapter}``: only served adapters' names, so the label set is
  bounded by what was loaded).

Both routes sit under ``/v1/``, so the API key guards them like every other.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from mstar.engine.lora.adapter import AdapterError
from mstar.engine.lora.manager import LoraManager
from mstar.engine.lora.pool import UnknownAdapter
from mstar.engine.server.body import read_json_body
from mstar.engine.server.errors import APIError, bad_request, model_not_found
from mstar.engine.server.state import STATE, ServerState


def lora_of(state: ServerState) -> LoraManager | None:
    return getattr(state.engine, "lora", None)


def resolve_model(state: ServerState, model: str | None) -> str | None:
    """The adapter a request's ``model`` names (None: the base); a 404 naming an unknown one."""
    if model is None or model == state.model_name:
        return None
    lora = lora_of(state)
    if lora is not None and lora.pool.known(model):
        return model
    raise model_not_found(model)


def adapter_cards(state: ServerState) -> list[dict[str, Any]]:
    """`/v1/models` entries of the served adapters (vLLM's: ``root`` the adapter's folder,
    ``parent`` the base model)."""
    lora = lora_of(state)
    if lora is None:
        return []
    paths = dict(lora.pool.paths)
    return [
        {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "mstar",
            "root": path,
            "parent": state.model_name,
            "max_model_len": state.max_model_len,
        }
        for name, path in paths.items()
    ]


def _name(body: Any) -> str:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise APIError(400, "lora_name must be a non-empty string", param="lora_name")
    return name


def _manager(request: web.Request) -> LoraManager:
    lora = lora_of(request.app[STATE])
    if lora is None:
        raise APIError(
            400, "LoRA is not enabled on this server (start it with --enable-lora)",
            param="lora_name", code="lora_not_enabled",
        )  # fmt: skip
    return lora


async def load_adapter(request: web.Request) -> web.Response:
    lora = _manager(request)
    body = await read_json_body(request)
    name = _name(body)
    path = body.get("lora_path")
    if not isinstance(path, str) or not path:
        raise APIError(400, "lora_path must be a non-empty string", param="lora_path")
    if name == request.app[STATE].model_name:
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    loop = asyncio.get_running_loop()
    try:  # reads the folder: off the event loop
        await loop.run_in_executor(None, lora.pool.register, name, path)
    except AdapterError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc
    return web.json_response({"status": "ok", "message": f"LoRA adapter {name!r} loaded"})


async def unload_adapter(request: web.Request) -> web.Response:
    lora = _manager(request)
    name = _name(await read_json_body(request))
    try:
        lora.pool.unregister(name)
    except UnknownAdapter as exc:
        raise APIError(
            404, f"The LoRA adapter `{name}` does not exist.", param="lora_name",
            code="model_not_found",
        ) from exc  # fmt: skip
    return web.json_response({"status": "ok", "message": f"LoRA adapter {name!r} unloaded"})


class LoraCollector(Collector):
    """The adapter metrics, computed at scrape time from the pool and the resource."""

    def __init__(self, lora: LoraManager, model_name: str) -> None:
        self.lora = lora
        self.model_name = model_name

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        running, waiting = self.lora.resource.running_and_waiting()
        labels = {
            "max_lora": str(self.lora.max_loras),
            "running_lora_adapters": ",".join(running),
            "waiting_lora_adapters": ",".join(waiting),
        }
        now = time.time()
        for prefix in ("vllm", "mstar"):
            info = GaugeMetricFamily(
                f"{prefix}:lora_requests_info", "Running stats on LoRA requests.",
                labels=list(labels),
            )  # fmt: skip
            info.add_metric(list(labels.values()), now)
            yield info
        c = self.lora.pool.counters
        m = [self.model_name]
        for name, doc, value in (
            ("loads", "LoRA adapters loaded into a slot.", c.loads),
            ("evictions", "Idle LoRA adapters evicted from their slot.", c.evictions),
            ("load_failures", "LoRA adapter loads that failed.", c.load_failures),
        ):
            counter = CounterMetricFamily(f"mstar:lora_{name}", doc, labels=["model_name"])
            counter.add_metric(m, value)
            yield counter
        for name, doc, label, counts in (
            ("refusals", "Rows refused admission for their adapter, by reason.", "reason",
             c.refusals),
            ("requests", "Requests that named each LoRA adapter (served ones only).", "adapter",
             c.requests),
        ):  # fmt: skip
            by = CounterMetricFamily(f"mstar:lora_{name}", doc, labels=["model_name", label])
            for key, n in sorted(counts.items()):
                by.add_metric([*m, key], n)
            yield by


def register_lora(app: web.Application) -> None:
    """The admin routes always (a 400 when LoRA is off), the metrics when it is on."""
    app.router.add_post("/v1/load_lora_adapter", load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_adapter)
    state = app[STATE]
    lora = lora_of(state)
    if lora is not None:
        state.metrics.registry.register(LoraCollector(lora, state.model_name))
