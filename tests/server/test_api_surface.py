"""The parameters agents send, on the tiny model through the `openai` client: logit_bias,
min_tokens, stop_token_ids, cached_tokens, /tokenize and /detokenize, a grammar the vocabulary
cannot spell (a stated finish reason, not a 5xx), and each bad input as a 400 naming its
parameter, refused before the engine holds anything."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from live_server import LiveServer, make_engine

TOOL: dict[str, Any] = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def live(tiny_chat_dir: Path) -> Iterator[LiveServer]:
    with LiveServer(make_engine(tiny_chat_dir)) as server:
        yield server


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


def _post(live: LiveServer, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    req = urllib.request.Request(
        live.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _complete(live: LiveServer, **kw: Any) -> Any:
    args: dict[str, Any] = dict(model="tiny", prompt="w5 w6 w7", max_tokens=8, temperature=0)
    args.update(kw)
    return _client(live).completions.create(**args)


def test_logit_bias_forces_and_forbids_tokens(live: LiveServer) -> None:
    forced = _complete(live, logit_bias={"9": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text.split() == ["w9"] * 8
    plain = _complete(live, extra_body={"ignore_eos": True}).choices[0].text.split()
    banned = _complete(live, logit_bias={str(int(plain[0][1:])): -100})
    assert banned.choices[0].text.split()[0] != plain[0]


def test_min_tokens_holds_eos_back(live: LiveServer) -> None:
    eos_first = _complete(live, logit_bias={"2": 100})
    assert (eos_first.choices[0].finish_reason, eos_first.usage.completion_tokens) == ("stop", 1)
    held = _complete(live, logit_bias={"2": 100}, extra_body={"min_tokens": 5})
    # five tokens that are not EOS, then EOS (still the most likely) ends it
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 6)
    # stop strings, too, are looked for only from the min_tokens-th token on
    early = _complete(live, logit_bias={"9": 100}, stop="w9")
    assert (early.choices[0].text.strip(), early.usage.completion_tokens) == ("", 1)
    late = _complete(live, logit_bias={"9": 100}, stop="w9", extra_body={"min_tokens": 3})
    assert late.choices[0].text.split() == ["w9", "w9"] and late.usage.completion_tokens == 3
    assert late.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_choice(live: LiveServer) -> None:
    out = _complete(live, logit_bias={"9": 100}, extra_body={"stop_token_ids": [9]})
    assert (out.choices[0].finish_reason, out.usage.completion_tokens) == ("stop", 1)


def test_usage_reports_prefix_cache_hits(live: LiveServer) -> None:
    prompt = " ".join(f"w{10 + i % 50}" for i in range(40))
    first = _complete(live, prompt=prompt, max_tokens=2)
    second = _client(live).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w8"}], max_completion_tokens=2
    )
    again = _complete(live, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details is not None
    # 40 prompt tokens in pages of 4: every full page but the one the last token needs
    assert again.usage.prompt_tokens_details.cached_tokens >= 36
    chunks = list(
        _client(live).completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 36


def test_tokenize_and_detokenize(live: LiveServer) -> None:
    status, body = _post(live, "/tokenize", {"model": "tiny", "prompt": "w5 w6 w7"})
    assert status == 200 and body["tokens"] == [5, 6, 7] and body["count"] == 3
    assert body["max_model_len"] == 512
    status, chat = _post(live, "/tokenize", {"messages": [{"role": "user", "content": "w9"}]})
    assert status == 200 and chat["tokens"] == [3, 9, 4, 5]  # the tiny template: w3 .. w4 w5
    status, body = _post(live, "/detokenize", {"tokens": [5, 6, 7]})
    assert (status, body) == (200, {"prompt": "w5 w6 w7"})
    assert _post(live, "/detokenize", {"tokens": [96]})[1]["error"]["param"] == "tokens"
    assert _post(live, "/tokenize", {"prompt": 5})[1]["error"]["param"] == "prompt"
    assert _post(live, "/tokenize", {"model": "other", "prompt": "w5"})[0] == 404


def test_a_grammar_the_vocabulary_cannot_spell_ends_the_choice(live: LiveServer) -> None:
    """The tiny vocabulary (w0..w95) has no '{': the JSON grammar allows no token at all."""
    client = _client(live)
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w9"}],
        max_completion_tokens=8,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "grammar_dead_end"
    assert out.choices[0].message.content == "" and out.usage.completion_tokens == 0
    streamed = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "w9"}],
            max_completion_tokens=8,
            response_format={"type": "json_object"},
            stream=True,
        )
    )
    assert [c.choices[0].finish_reason for c in streamed][-1] == "grammar_dead_end"
    live.wait_metric("mstar:num_requests_running", 0.0, model_name="tiny")


BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "invalid schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "foo"}},
            }
        },
        "response_format",
    ),
    (
        "impossible bounds",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "integer", "minimum": 5, "maximum": 1},
                },
            }
        },
        "response_format",
    ),
    (
        "unsupported feature",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {"type": "object", "not": {"required": ["a"]}},
                },
            }
        },
        "response_format",
    ),
    (
        "remote $ref",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}},
            }
        },
        "response_format",
    ),
    (
        "schema without a name",
        {"response_format": {"type": "json_schema", "json_schema": {}}},
        "response_format",
    ),
    ("unknown format type", {"response_format": {"type": "yaml"}}, "response_format"),
    (
        "strict not a boolean",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
        "response_format",
    ),
    (
        "tool without a name",
        {"tools": [{"type": "function", "function": {"parameters": {}}}]},
        "tools",
    ),
    ("tool of another type", {"tools": [{"type": "retrieval"}]}, "tools"),
    ("duplicate tool names", {"tools": [TOOL, TOOL]}, "tools"),
    (
        "tool with an invalid schema",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}
            ],
            "tool_choice": "required",
        },
        "tools",
    ),
    (
        "tool_choice naming an absent tool",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ("tool_choice without tools", {"tool_choice": "required"}, "tool_choice"),
    ("unknown tool_choice", {"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    (
        "parallel_tool_calls not a bool",
        {"tools": [TOOL], "parallel_tool_calls": "yes"},
        "parallel_tool_calls",
    ),
    ("logit_bias key out of the vocabulary", {"logit_bias": {"96": 1}}, "logit_bias"),
    ("logit_bias key not a token id", {"logit_bias": {"w5": 1}}, "logit_bias"),
    ("logit_bias value out of range", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("min_tokens over max", {"min_tokens": 9, "max_completion_tokens": 4}, "min_tokens"),
    ("negative min_tokens", {"min_tokens": -1}, "min_tokens"),
]


@pytest.mark.parametrize(("case", "extra", "param"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_input_is_a_400_naming_the_parameter(
    live: LiveServer, case: str, extra: dict[str, Any], param: str
) -> None:
    engine = live.engine
    deadline = time.monotonic() + 30
    while engine.scheduler.requests and time.monotonic() < deadline:
        time.sleep(0.01)  # an earlier test's stop-string abort may still be on its way
    free = engine.stats().num_free_pages
    body = {"model": "tiny", "messages": [{"role": "user", "content": "w5"}], **extra}
    status, answer = _post(live, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
    assert answer["error"]["message"]
    # refused before the engine: no request, no page taken
    assert not engine.scheduler.requests and engine.stats().num_free_pages == free
