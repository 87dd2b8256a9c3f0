"""LoRA through the server: vLLM's load/unload routes and their errors, `/v1/models` with each
adapter's parent, a request's `model` naming an adapter (served as the offline engine serves
it; a 404 naming an unknown one), the first request for an adapter refused while it loads
(span event in Jaeger and `mstar:admit_failures_total`) then served, the endpoint picker's
`vllm:lora_requests_info`, and the API key on the admin routes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from jaeger import Jaeger, log_fields
from live_server import LiveServer, make_engine
from lora_adapters import build_adapter
from openapi_spec_validator import validate

from mstar.engine.sampling_params import SamplingParams
from mstar.engine.server.state import STATE
from mstar.engine.server.telemetry import REQUEST_SPAN_NAME, Telemetry

from .test_openai_e2e import raw

PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora-server")
    return {
        "a1": build_adapter(tiny_llama_dir, root / "a1", 8, 21),
        "a2": build_adapter(tiny_llama_dir, root / "a2", 16, 22, ["q_proj", "down_proj"]),
        "big": build_adapter(tiny_llama_dir, root / "big", 64, 23, ["o_proj"]),
    }


def _lora_engine(model: Path, a1: Path) -> Any:
    return make_engine(
        model, enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=[f"a1={a1}"]
    )


def _error(status_body: Any) -> tuple[int, str | None]:
    status, body, _ = status_body
    return status, body["error"]["param"]


def test_lora_serving(tiny_chat_dir: Path, adapters: dict[str, Path], jaeger: Jaeger) -> None:
    offline = _lora_engine(tiny_chat_dir, adapters["a1"])
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name="a1")
    want = offline.tokenizer.decode(offline.generate([PROMPT], greedy)[0])
    base = offline.tokenizer.decode(
        offline.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[
            0
        ]
    )
    assert want != base
    engine = _lora_engine(tiny_chat_dir, adapters["a1"])
    telemetry = Telemetry(service_name="lora", endpoint=jaeger.otlp_url + "/v1/traces")
    with LiveServer(engine, telemetry=telemetry) as live:
        status, models = live.get("/v1/models")
        cards = {c["id"]: c for c in json.loads(models)["data"]}
        assert set(cards) == {"tiny", "a1"} and cards["a1"]["parent"] == "tiny"
        assert cards["a1"]["root"] == str(adapters["a1"])

        body = {"model": "a1", "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        status, out, _ = raw(live, "/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"].strip() == want.strip()
        assert out["model"] == "a1"  # the adapter the request named, as vLLM answers
        assert (
            live.metric("mstar:admit_failures_total", reason="AdapterLoading", resource="adapter")
            >= 1
        )
        assert live.metric("mstar:lora_loads_total") == 1
        info = [
            dict(labels) for (name, labels) in live.metrics() if name == "vllm:lora_requests_info"
        ]
        # idle but resident: "running" for the picker (loaded and ready to serve)
        assert info == [
            {"max_lora": "2", "running_lora_adapters": "a1", "waiting_lora_adapters": ""}
        ]
        assert any(n == "mstar:lora_requests_info" for n, _ in live.metrics())
        assert live.metric("mstar:lora_requests_total", adapter="a1") == 1
        assert live.app[STATE].telemetry.force_flush()
        (trace,) = jaeger.wait_for("lora", lambda t: len(t) == 1)
        (root,) = [s for s in trace["spans"] if s["operationName"] == REQUEST_SPAN_NAME]
        refused = [log_fields(log) for log in root["logs"]]
        assert refused and all(
            e["event"] == "admit_refused" and e["reason"] == "AdapterLoading"
            and e["resource"] == "adapter" for e in refused
        )  # fmt: skip

        load = {"lora_name": "a2", "lora_path": str(adapters["a2"])}
        status, out, _ = raw(live, "/v1/load_lora_adapter", load)
        assert status == 200, out
        status, models = live.get("/v1/models")
        assert "a2" in {c["id"] for c in json.loads(models)["data"]}
        assert _error(raw(live, "/v1/load_lora_adapter", load)) == (400, "lora_name")
        big = {"lora_name": "big", "lora_path": str(adapters["big"])}
        assert _error(raw(live, "/v1/load_lora_adapter", big)) == (400, "lora_path")
        gone = {"lora_name": "g", "lora_path": "/nonexistent/adapter"}
        assert _error(raw(live, "/v1/load_lora_adapter", gone)) == (400, "lora_path")
        assert _error(raw(live, "/v1/load_lora_adapter", {"lora_path": "x"})) == (400, "lora_name")
        body["model"] = "a2"
        status, out, _ = raw(live, "/v1/completions", body)
        assert status == 200 and out["choices"][0]["text"].strip() != want.strip()
        assert live.metric("mstar:lora_requests_total", adapter="a2") == 1
        running = _running(live)
        assert set(running) == {"a1", "a2"}

        unload = {"lora_name": "a2"}
        assert raw(live, "/v1/unload_lora_adapter", unload)[0] == 200
        assert _running(live) == ["a1"]
        assert _error(raw(live, "/v1/unload_lora_adapter", unload)) == (404, "lora_name")
        assert _error(raw(live, "/v1/completions", body)) == (404, "model")
        body["model"] = "nope"
        assert _error(raw(live, "/v1/completions", body)) == (404, "model")


def _running(live: LiveServer) -> list[str]:
    (labels,) = [dict(ls) for (n, ls) in live.metrics() if n == "vllm:lora_requests_info"]
    return [a for a in labels["running_lora_adapters"].split(",") if a]


def test_responses_name_the_adapter(tiny_chat_dir: Path, adapters: dict[str, Path]) -> None:
    """The response's `model` (chat, completions, every streamed chunk) is the adapter the
    request named, the base model's name otherwise; the OpenAPI document lists the admin
    routes when LoRA is on."""
    engine = _lora_engine(tiny_chat_dir, adapters["a1"])
    with LiveServer(engine) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        chat = [{"role": "user", "content": "hi"}]
        assert client.chat.completions.create(model="a1", messages=chat, max_tokens=2).model == "a1"
        streamed = client.chat.completions.create(
            model="a1", messages=chat, max_tokens=2, stream=True
        )
        assert {c.model for c in streamed} == {"a1"}
        text = client.completions.create(model="a1", prompt=PROMPT, max_tokens=2, stream=True)
        assert {c.model for c in text} == {"a1"}
        assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).model == "tiny"
        assert live.metric("mstar:lora_requests_total", adapter="a1") == 3
        status, doc = live.get("/openapi.json")
        assert status == 200
        validate(json.loads(doc))
        paths = json.loads(doc)["paths"]
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= set(paths)


def test_admin_routes_behind_the_api_key(tiny_chat_dir: Path, adapters: dict[str, Path]) -> None:
    engine = _lora_engine(tiny_chat_dir, adapters["a1"])
    with LiveServer(engine, api_key="sekret") as live:
        load = {"lora_name": "a2", "lora_path": str(adapters["a2"])}
        assert raw(live, "/v1/load_lora_adapter", load)[0] == 401
        assert raw(live, "/v1/unload_lora_adapter", {"lora_name": "a1"})[0] == 401
        auth = {"Authorization": "Bearer sekret"}
        assert raw(live, "/v1/load_lora_adapter", load, auth)[0] == 200


def test_routes_say_lora_is_off(server: LiveServer) -> None:
    status, out, _ = raw(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert status == 400 and out["error"]["code"] == "lora_not_enabled"
