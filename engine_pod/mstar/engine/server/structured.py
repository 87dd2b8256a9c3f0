"""Structured output with tools, as OpenAI combines them.

`response_format` constrains the assistant's content; a forced `tool_choice` constrains the
call it must make. OpenAI accepts both in one request (agent SDKs send both on every turn): the
forced call comes first and the format applies to a later answer in content, so here a forced
choice's grammar is the call's and the format waits for a turn whose choice is not forced. With
`tool_choice` auto and a format, the reply is either a tool call or the format's content: one
grammar admits both (`GrammarSpec.calls`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from mstar.engine.sampling_params import GrammarSpec, InvalidParameter
from mstar.engine.server.tools import ToolConfig, call_schema

#: Most calls a `tool_choice` auto turn with a format may make when `parallel_tool_calls` is
#: true (the grammar lists each count as an alternative, so it needs a number).
MAX_LISTED_CALLS = 8


def parse_response_format(body: dict[str, Any]) -> GrammarSpec | None:
    """`response_format`: text (no grammar), json_object, or json_schema {name, schema, strict}.

    Compiling the schema (which finds what is wrong with it) is the server's next step;
    `InvalidParameter` names `response_format` for what is malformed here."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    param = "response_format"
    if not isinstance(fmt, dict):
        raise InvalidParameter(param, f"'{param}' must be an object, got {type(fmt).__name__}")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise InvalidParameter(
            param, "'response_format.type' must be 'text', 'json_object' or 'json_schema'"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidParameter(param, "'response_format.json_schema' must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidParameter(
            param, "'response_format.json_schema.name' must be a non-empty string"
        )
    schema = spec.get("schema", {})
    if not isinstance(schema, dict | bool):
        raise InvalidParameter(param, "'response_format.json_schema.schema' must be a JSON schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidParameter(param, "'response_format.json_schema.strict' must be a boolean")
    return GrammarSpec.json_schema(schema, bool(strict))  # type: ignore[arg-type]


def request_grammar(fmt: GrammarSpec | None, tools: ToolConfig | None) -> GrammarSpec | None:
    """The grammar one chat turn decodes under, from its `response_format` and its tools."""
    if tools is None or tools.choice == "none":
        return fmt
    if tools.forced:
        return tools.grammar()  # the call now; the format applies to a later content answer
    if fmt is None:
        return None  # auto without a format: the model is free, calls are read from its text
    one_call = {"anyOf": [call_schema(t) for t in tools.tools]}
    most = tools.max_calls or MAX_LISTED_CALLS
    return dataclasses.replace(fmt, calls=json.dumps(one_call), max_calls=most)
