"""Tool calling's pure parts: the `auto` parser (Hermes / Qwen2.5 `<tool_call>` blocks), the
streamed deltas, the forced-choice grammars and how conversations with calls are rendered."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from mstar.engine.sampling_params import GrammarSpec, InvalidParameter
from mstar.engine.server.structured import request_grammar
from mstar.engine.server.tools import (
    ToolStream,
    parse_output,
    parse_tools,
    reported_reason,
    template_messages,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}


def _config(choice: Any = "auto", parallel: bool | None = None) -> Any:
    body: dict[str, Any] = {"tools": [WEATHER, CLOCK], "tool_choice": choice}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    config = parse_tools(body)
    assert config is not None
    return config


AUTO_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def test_auto_reads_hermes_calls_and_keeps_the_rest_as_content() -> None:
    content, calls = parse_output(_config(), AUTO_TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a call of an undeclared tool, or a block that is not JSON: the text is the answer
    for text in (
        '<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
        "<tool_call>{</tool_call>",
    ):
        assert parse_output(_config(), text) == (text, [])
    assert parse_output(_config("none"), AUTO_TEXT) == (AUTO_TEXT, [])


def test_auto_stream_sends_content_then_whole_calls() -> None:
    stream = ToolStream(_config())
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(AUTO_TEXT), 3):  # arbitrary cuts, '<tool_call>' split across them
        deltas += stream.feed(AUTO_TEXT[i : i + 3])
    last, reason = stream.end("stop")
    content = "".join(d["content"] for d in deltas)
    assert content == "Let me check.\n" and reason == "tool_calls"
    assert [d["tool_calls"][0]["index"] for d in last] == [0, 1]
    plain = ToolStream(_config())
    sent = plain.feed("no call <tool") + plain.feed(" here")
    tail, reason = plain.end("length")
    assert "".join(d["content"] for d in sent + tail) == "no call <tool here" and reason == "length"


def test_named_choice_streams_arguments_into_one_call() -> None:
    stream = ToolStream(_config({"type": "function", "function": {"name": "get_weather"}}))
    first = stream.feed('{"city"')
    rest = stream.feed(': "Oslo"}')
    assert first[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert rest == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Oslo"}'}}]}]
    assert stream.end("stop") == ([], "tool_calls")


def test_forced_grammars_describe_the_declared_calls() -> None:
    named = _config({"type": "function", "function": {"name": "get_weather"}}).grammar()
    assert json.loads(named.schema) == WEATHER["function"]["parameters"]
    required = json.loads(_config("required", parallel=False).grammar().schema)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], required)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel calls
        jsonschema.validate([{"name": "get_time", "arguments": {}}] * 2, required)
    # parallel_tool_calls unset: at most one call per declared tool; true: any number
    unset = json.loads(_config("required").grammar().schema)
    assert unset["maxItems"] == 2
    assert "maxItems" not in json.loads(_config("required", parallel=True).grammar().schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "arguments": {}}], required)
    assert _config("auto").grammar() is None and _config("none").grammar() is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "description": {}}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_name_their_parameter(body: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as err:
        parse_tools(body)
    assert err.value.param == param


def test_conversations_with_calls_render_for_both_kinds_of_template() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    native = template_messages(messages, [WEATHER], native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    hermes = template_messages(messages, [WEATHER], native=False)
    assert hermes[0]["role"] == "system" and '"get_weather"' in hermes[0]["content"]
    assert hermes[2]["content"].startswith("<tool_call>") and "Paris" in hermes[2]["content"]
    assert hermes[3] == messages[2]


def test_a_cut_list_of_calls_keeps_its_complete_calls() -> None:
    """max_tokens cut the list: the complete calls come back, the cut tail is dropped and the
    reason stays "length"."""
    cut = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"ci'
    content, calls = parse_output(_config("required"), cut)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    assert reported_reason(_config("required"), cut, "length") == "length"
    auto = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>\n{"na'
    content, calls = parse_output(_config("auto"), auto)
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time"]
    whole = '[{"name": "get_time", "arguments": {}}]'
    assert reported_reason(_config("required"), whole, "stop") == "tool_calls"
    assert reported_reason(_config("auto"), "plain words", "stop") == "stop"
    assert reported_reason(None, whole, "stop") == "stop"


def test_response_format_with_tools_as_openai_combines_them() -> None:
    """Forced: the call's grammar (the format waits for a later content turn). Auto: content in
    the format or tool calls, one grammar for both. None: the format alone."""
    fmt = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    forced = request_grammar(fmt, _config("required"))
    assert forced == _config("required").grammar()
    auto = request_grammar(fmt, _config("auto"))
    assert auto is not None and auto.schema == fmt.schema and auto.max_calls == 2
    names = {a["properties"]["name"]["const"] for a in json.loads(auto.calls)["anyOf"]}
    assert names == {"get_weather", "get_time"}
    assert request_grammar(fmt, _config("none")) == fmt
    assert request_grammar(None, _config("auto")) is None
