"""The OpenAPI 3.1 document of the served routes, answered at `/openapi.json` (as vLLM does).

The request schemas state what `protocol.py` accepts, field by field, with the same bounds:
whatever a schema rejects, the server answers with a 4xx (the API fuzzer in the tests holds
both to that). What only the running model can decide (prompt length against the context,
tokens in the vocabulary, `best_of == n`) is left to the server and answered 400.
"""

from __future__ import annotations

from typing import Any

from mstar.engine.outputs import FinishReason
from mstar.engine.sampling_params import FLOAT_BOUNDS, LOGIT_BIAS_BOUND
from mstar.engine.server.protocol import CHAT_ROLES, INT64, MAX_N, MAX_TOP_LOGPROBS

JSON = "application/json"
Schema = dict[str, Any]


def _nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> Schema:
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
    "stream_options": _nullable(
        {"type": "object", "properties": {"include_usage": _flag()}},
    ),
    "best_of": _int(1),
    "logit_bias": _nullable(
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
    "response_format": _nullable(
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
    "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
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
        "tool_calls": _nullable({"type": "array", "items": _ref("ToolCall")}),
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
            "tools": _nullable({"type": "array", "items": TOOL}),
            "tool_choice": TOOL_CHOICE,
            "parallel_tool_calls": _flag(),
        },
        "messages",
        top_rule,
        _only_when("prompt_logprobs", {"properties": {"stream": {"enum": [False, None]}}}),
    )


FINISH_REASON: Schema = {"enum": [r.value for r in FinishReason]}

USAGE: Schema = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        **{
            k: {"type": "integer", "minimum": 0}
            for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        "prompt_tokens_details": {
            "type": "object",
            "required": ["cached_tokens"],
            "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
        },
    },
}

COMPLETION_LOGPROBS: Schema = {
    "type": "object",
    "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
    "properties": {
        "tokens": {"type": "array", "items": {"type": "string"}},
        # null for an echoed prompt's first token (it has no context)
        "token_logprobs": {"type": "array", "items": {"type": ["number", "null"], "maximum": 0}},
        "top_logprobs": {
            "type": "array",
            "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
        },
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}

CHAT_TOKEN: Schema = {
    "type": "object",
    "required": ["token", "logprob", "bytes"],
    "properties": {
        "token": {"type": "string"},
        "logprob": {"type": "number", "maximum": 0},
        "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}},
    },
}

CHAT_LOGPROBS: Schema = {
    "type": "object",
    "required": ["content"],
    "properties": {
        "content": {
            "type": "array",
            "items": {
                **CHAT_TOKEN,
                "required": [*CHAT_TOKEN["required"], "top_logprobs"],
                "properties": {
                    **CHAT_TOKEN["properties"],
                    "top_logprobs": {"type": "array", "items": CHAT_TOKEN},
                },
            },
        }
    },
}


def _response(obj: str, field: str, content: Schema, logprobs: Schema) -> Schema:
    """A non-streamed response whose choices carry `field` (text or message)."""
    choice = {
        "type": "object",
        "required": ["index", field, "logprobs", "finish_reason"],
        "properties": {
            "index": {"type": "integer", "minimum": 0},
            field: content,
            "logprobs": _nullable(logprobs),
            "finish_reason": FINISH_REASON,
        },
    }
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": obj},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice, "minItems": 1},
            "usage": USAGE,
        },
    }


COMPLETION_RESPONSE = _response("text_completion", "text", {"type": "string"}, COMPLETION_LOGPROBS)
ASSISTANT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"const": "assistant"},
        "content": {"type": ["string", "null"]},
        "tool_calls": {"type": "array", "items": _ref("ToolCall")},
    },
}
CHAT_RESPONSE = _response("chat.completion", "message", ASSISTANT_MESSAGE, CHAT_LOGPROBS)

ERROR: Schema = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string", "minLength": 1},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}

MODELS: Schema = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by", "max_model_len"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                    "root": {"type": "string"},
                    "max_model_len": {"type": "integer", "minimum": 1},
                },
            },
        },
    },
}

STATUS: Schema = {
    "type": "object",
    "required": ["status"],
    "properties": {"status": {"type": "string"}},
}

ERROR_STATUSES = {
    "400": "Malformed body, wrong type, out-of-range value, or a prompt that does not fit.",
    "404": "No such model (`param: model`).",
    "413": "The body is larger than the server accepts.",
    "429": "Too many waiting requests; retry after `Retry-After` seconds.",
    "500": "The engine failed while running the request.",
    "503": "The server is draining or its engine loop died.",
}


def _error(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": _ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


def _generation(summary: str, request: str, response: str, guarded: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "The completion; with `stream: true`, server-sent events.",
            "content": {JSON: {"schema": _ref(response)}, "text/event-stream": {"schema": {}}},
        },
        **{code: _error(text) for code, text in ERROR_STATUSES.items()},
    }
    responses["429"] = _error(
        ERROR_STATUSES["429"], {"Retry-After": {"schema": {"type": "integer", "minimum": 0}}}
    )
    if guarded:
        responses["401"] = _error("Missing or wrong API key.")
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": _ref(request)}}},
        "responses": responses,
    }


def _probe(summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            "200": {"description": "Up.", "content": {JSON: {"schema": _ref("Status")}}},
            "503": {"description": "Not up.", "content": {JSON: {"schema": _ref("Status")}}},
        },
    }


def openapi_document(model_name: str, max_model_len: int, guarded: bool) -> dict[str, Any]:
    """The document of one app; `guarded` when `/v1/*` needs the API key (bearer)."""
    models: dict[str, Any] = {
        "summary": "The served model.",
        "responses": {
            "200": {"description": "One model.", "content": {JSON: {"schema": _ref("Models")}}}
        },
    }
    if guarded:
        models["responses"]["401"] = _error("Missing or wrong API key.")
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "mstar engine",
            "version": "1",
            "description": f"OpenAI-compatible routes serving `{model_name}`.",
        },
        "paths": {
            "/v1/completions": {
                "post": _generation(
                    "Text completion.", "CompletionRequest", "CompletionResponse", guarded
                )
            },
            "/v1/chat/completions": {
                "post": _generation(
                    "Chat completion.", "ChatCompletionRequest", "ChatCompletionResponse", guarded
                )
            },
            "/v1/models": {"get": models},
            "/health": {"get": _probe("Liveness: the engine loop runs.")},
            "/ready": {"get": _probe("Readiness: loaded, loop alive, not draining.")},
            "/metrics": {
                "get": {
                    "summary": "Prometheus text format 0.0.4.",
                    "responses": {
                        "200": {
                            "description": "The metrics.",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "responses": {
                        "200": {
                            "description": "OpenAPI 3.1.",
                            "content": {JSON: {"schema": {"type": "object"}}},
                        }
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "CompletionRequest": completion_request(max_model_len),
                "ChatCompletionRequest": chat_request(max_model_len),
                "CompletionResponse": COMPLETION_RESPONSE,
                "ChatCompletionResponse": CHAT_RESPONSE,
                "Models": MODELS,
                "Status": STATUS,
                "ToolCall": TOOL_CALL,
                "Error": ERROR,
            }
        },
    }
    if guarded:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return doc
