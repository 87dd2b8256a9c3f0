"""The request schemas of the OpenAPI document (`openapi`): what `protocol.py` accepts, field
by field, with the same bounds (whatever a schema rejects, the server answers with a 4xx; the
API fuzzer in the tests holds both to that), and the schema helpers the document shares.
"""

from __future__ import annotations

from typing import Any

from mstar.engine.sampling_params import FLOAT_BOUNDS, LOGIT_BIAS_BOUND
from mstar.engine.server.protocol import CHAT_ROLES, INT64, MAX_N, MAX_TOP_LOGPROBS

JSON = "application/json"
Schema = dict[str, Any]


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _flag() -> Schema:
    return {"type": ["boolean", "null"]}


def _int(lo: int | None = None, hi: int | None = None) -> Schema:
    schema: Schema = {"type": ["integer", "null"]}
    if lo is not None:
        schema["minimum"] = lo
    if hi is not None:
        schema["maximum"] = hi
    return schema


def _number(name: str) -> Schema:
    """A float parameter, in the range `SamplingParams` checks (`FLOAT_BOUNDS`)."""
    bound = FLOAT_BOUNDS[name]
    schema: Schema = {"type": ["number", "null"], "maximum": bound.hi}
    schema["exclusiveMinimum" if bound.lo_open else "minimum"] = bound.lo
    return schema


def _object(required: list[str], properties: Schema) -> Schema:
    return {"type": "object", "required": required, "properties": properties}


def _function(required: list[str], properties: Schema) -> Schema:
    """`{"type": "function", "function": {...}}`: a tool, a tool call, a named tool choice."""
    return _object(
        ["type", "function"],
        {"type": {"const": "function"}, "function": _object(required, properties)},
    )


TOKEN_IDS: Schema = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}

#: Fields both generation routes take (`protocol._common`).
COMMON: dict[str, Schema] = {
    "model": {"type": ["string", "null"]},
    "n": _int(1, MAX_N),
    "stream": _flag(),
    "stream_options": nullable(
        {"type": "object", "properties": {"include_usage": _flag()}},
    ),
    "best_of": _int(1),
    "logit_bias": nullable(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": {
                "type": "number",
                "minimum": -LOGIT_BIAS_BOUND,
                "maximum": LOGIT_BIAS_BOUND,
            },
        }
    ),
    "min_tokens": _int(0),
    "response_format": nullable(
        {
            "anyOf": [
                _object(["type"], {"type": {"enum": ["text", "json_object"]}}),
                _object(
                    ["type", "json_schema"],
                    {
                        "type": {"const": "json_schema"},
                        "json_schema": _object(
                            ["name"],
                            {
                                "name": {"type": "string", "minLength": 1},
                                "schema": {"type": ["object", "boolean"]},
                                "strict": _flag(),
                            },
                        ),
                    },
                ),
            ]
        }
    ),
    "seed": _int(-INT64, INT64 - 1),
    "temperature": _number("temperature"),
    "top_p": _number("top_p"),
    "top_k": _int(-1),
    "min_p": _number("min_p"),
    "repetition_penalty": _number("repetition_penalty"),
    "presence_penalty": _number("presence_penalty"),
    "frequency_penalty": _number("frequency_penalty"),
    "stop": {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": {"type": "string", "minLength": 1}},
            {"type": "null"},
        ]
    },
    "stop_token_ids": nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
    "ignore_eos": _flag(),
    "include_stop_str_in_output": _flag(),
    "skip_special_tokens": _flag(),
    "prompt_logprobs": _int(0, MAX_TOP_LOGPROBS),  # vLLM's; also echo + logprobs
}

TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": sorted(CHAT_ROLES)},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}, {"type": "null"}]
        },
        "name": {"type": ["string", "null"]},
        "tool_call_id": {"type": ["string", "null"]},
        "tool_calls": nullable({"type": "array", "items": ref("ToolCall")}),
    },
}

TOOL_CALL: Schema = _function(
    ["name", "arguments"], {"name": {"type": "string"}, "arguments": {"type": "string"}}
)
TOOL_CALL["required"] = ["function"]  # `id` and `type` may be left out
TOOL_CALL["properties"]["id"] = {"type": "string"}

TOOL: Schema = _function(
    ["name"],
    {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
        "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]},
    },
)

TOOL_CHOICE: Schema = {
    "anyOf": [
        {"enum": ["none", "auto", "required"]},
        _function(["name"], {"name": {"type": "string", "minLength": 1}}),
        {"type": "null"},
    ]
}


def _only_when(field: str, requirement: Schema) -> Schema:
    """`field` set (not null) requires `requirement` (e.g. stream_options needs stream: true)."""
    return {
        "if": {"required": [field], "properties": {field: {"not": {"type": "null"}}}},
        "then": requirement,
    }


def _request(properties: dict[str, Schema], required: str, *rules: Schema) -> Schema:
    stream_rule = _only_when(
        "stream_options", {"required": ["stream"], "properties": {"stream": {"const": True}}}
    )
    return {
        "type": "object",
        "required": [required],
        "properties": {**COMMON, **properties},
        "allOf": [stream_rule, *rules],
    }


def completion_request(max_model_len: int) -> Schema:
    """`/v1/completions`; `max_tokens` leaves at least one prompt token in the context."""
    return _request(
        {
            "prompt": {
                "anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}, "minItems": 1},
                    TOKEN_IDS,
                    {"type": "array", "items": TOKEN_IDS, "minItems": 1},
                ]
            },
            "max_tokens": _int(1, max_model_len - 1),
            "echo": _flag(),
            "logprobs": _int(0, MAX_TOP_LOGPROBS),
            "suffix": {"type": "null"},
        },
        "prompt",
    )


def chat_request(max_model_len: int) -> Schema:
    """`/v1/chat/completions`; `top_logprobs` needs `logprobs: true`."""
    top_rule = _only_when(
        "top_logprobs", {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}
    )
    return _request(
        {
            "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            # Deprecated; ignored when max_completion_tokens is given, so no context bound.
            "max_tokens": _int(1),
            "max_completion_tokens": _int(1, max_model_len - 1),
            "logprobs": _flag(),
            "top_logprobs": _int(0, MAX_TOP_LOGPROBS),
            "tools": nullable({"type": "array", "items": TOOL}),
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": _flag(),
        },
        "messages",
        top_rule,
        _only_when("prompt_logprobs", {"properties": {"stream": {"enum": [False, None]}}}),
    )
