"""Structured outputs and forced tool calls on the real SmolLM2, through the `openai` client.

Every output must parse and validate (`jsonschema`) against the schema it was constrained to:
nested objects, arrays, enums, bounded numbers, patterned strings; chat and completions,
streamed and not, and on a KV pool so small that requests are evicted and recomputed
mid-generation (the grammar state must survive that without re-advancing).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest
from live_server import LiveServer

from mstar.engine.config import EngineConfig

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["engineer", "doctor", "teacher"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
    "additionalProperties": False,
}

INVENTORY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 2,
            "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                    "count": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["sku", "count", "price", "in_stock"],
                "additionalProperties": False,
            },
        },
        "currency": {"enum": ["EUR", "USD"]},
    },
    "required": ["items", "currency"],
    "additionalProperties": False,
}

SCHEMAS = {"person": PERSON, "inventory": INVENTORY}
PROMPTS = {
    "person": "Describe a fictional person as JSON.",
    "inventory": "List a few products in a shop's inventory as JSON.",
}
WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {
                    "zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}/[A-Z][a-z]{1,12}$"}
                },
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]


def _fmt(name: str) -> Any:
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _chat(client: openai.OpenAI, name: str, stream: bool, **kw: Any) -> tuple[str, str | None]:
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[name]}],
        max_completion_tokens=200,
        response_format=_fmt(name),
        **kw,
    )
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content or "", out.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate_streamed_and_not(smol_exact: LiveServer, name: str) -> None:
    client = _client(smol_exact)
    greedy, reason = _chat(client, name, stream=False, temperature=0)
    assert reason == "stop"
    jsonschema.validate(json.loads(greedy), SCHEMAS[name])
    streamed, reason = _chat(client, name, stream=True, temperature=0)
    assert (streamed, reason) == (greedy, "stop")
    for seed in range(3):  # sampled outputs too: the mask holds whatever the draw
        text, reason = _chat(client, name, stream=seed == 1, temperature=1.0, seed=seed)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_completions_json_schema_and_json_object(smol_exact: LiveServer) -> None:
    client = _client(smol_exact)
    out = client.completions.create(
        model=MODEL,
        prompt="A person, as JSON: ",
        max_tokens=200,
        temperature=0.7,
        seed=3,
        extra_body={"response_format": _fmt("person")},
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
    # with ignore_eos the grammar still ends the output: EOS completes it, then nothing is left
    done = client.completions.create(
        model=MODEL,
        prompt="A person, as JSON: ",
        max_tokens=200,
        temperature=0,
        extra_body={"response_format": _fmt("person"), "ignore_eos": True},
    )
    assert done.choices[0].finish_reason == "stop" and done.usage.completion_tokens < 200
    jsonschema.validate(json.loads(done.choices[0].text), PERSON)
    text = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL,
            prompt="A city and its country, as JSON: ",
            max_tokens=120,
            temperature=0,
            stream=True,
            extra_body={"response_format": {"type": "json_object"}},
        )
        if c.choices
    )
    assert isinstance(json.loads(text), dict)


def test_forced_tool_calls_validate(smol_exact: LiveServer) -> None:
    client = _client(smol_exact)
    params = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_TOOLS}
    messages: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for seed in range(2):
            out = client.chat.completions.create(
                model=MODEL,
                messages=messages,
                tools=WEATHER_TOOLS,  # type: ignore[arg-type]
                tool_choice=choice,  # type: ignore[arg-type]
                parallel_tool_calls=False,
                max_completion_tokens=120,
                temperature=1.0,
                seed=seed,
            )
            message = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls"
            assert message.content is None and message.tool_calls and len(message.tool_calls) == 1
            call = message.tool_calls[0]
            assert call.type == "function" and call.id.startswith("call_")
            if isinstance(choice, dict):
                assert call.function.name == "get_time"
            jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    # streamed: the named function's arguments arrive as deltas of one call
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=WEATHER_TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_completion_tokens=120,
            temperature=0,
            stream=True,
        )
    )
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
    assert len(deltas) > 2 and all(d.index == 0 for d in deltas)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function)
    jsonschema.validate(json.loads(arguments), params["get_weather"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_parallel_required_calls_and_a_tool_conversation(smol_exact: LiveServer) -> None:
    client = _client(smol_exact)
    out = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Paris", "unit": "celsius"}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
            {"role": "user", "content": "And what time is it in Europe/Paris and Asia/Tokyo?"},
        ],
        tools=WEATHER_TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_completion_tokens=200,
        temperature=0,
    )
    calls = out.choices[0].message.tool_calls or []
    assert calls and out.choices[0].finish_reason == "tool_calls"
    params = {t["function"]["name"]: t["function"]["parameters"] for t in WEATHER_TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])


def test_grammar_survives_eviction_and_recompute() -> None:
    """A pool of 24 pages (16 tokens each) for 6 concurrent requests: running requests are
    evicted (no host pool: recomputed) mid-generation, and every output still validates."""
    from mstar.engine.engine import LLMEngine

    engine = LLMEngine.from_config(
        EngineConfig(device="cpu", num_pages=24, page_size=16, host_offload_gb=0.0)
    )
    with LiveServer(engine) as live:
        client = _client(live)

        def one(i: int) -> tuple[str, str | None]:
            name = sorted(SCHEMAS)[i % 2]
            return _chat(client, name, stream=i % 3 == 0, temperature=1.0, seed=i)

        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(one, range(6)))
        assert engine.counters.recomputations > 0
        for i, (text, reason) in enumerate(results):
            assert reason == "stop", text
            jsonschema.validate(json.loads(text), SCHEMAS[sorted(SCHEMAS)[i % 2]])
        live.wait_metric("mstar:num_requests_running", 0.0, model_name=MODEL)
