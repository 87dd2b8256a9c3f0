"""The OpenAPI 3.1 document of the served routes, answered at `/openapi.json` (as vLLM does).

The request schemas (`openapi_requests`) state what `protocol.py` accepts, field by field, with
the same bounds: whatever a schema rejects, the server answers with a 4xx (the API fuzzer in the
tests holds both to that). What only the running model can decide (prompt length against the
context, tokens in the vocabulary, `best_of == n`) is left to the server and answered 400.
"""

from __future__ import annotations

from typing import Any

from mstar.engine.outputs import FinishReason
from mstar.engine.server.openapi_requests import (
    JSON,
    TOOL_CALL,
    Schema,
    chat_request,
    completion_request,
    nullable,
    ref,
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
            "logprobs": nullable(logprobs),
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
        "tool_calls": {"type": "array", "items": ref("ToolCall")},
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
                    "parent": {"type": ["string", "null"]},
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
    out: dict[str, Any] = {"description": description, "content": {JSON: {"schema": ref("Error")}}}
    if headers:
        out["headers"] = headers
    return out


def _generation(summary: str, request: str, response: str, guarded: bool) -> dict[str, Any]:
    responses: dict[str, Any] = {
        "200": {
            "description": "The completion; with `stream: true`, server-sent events.",
            "content": {JSON: {"schema": ref(response)}, "text/event-stream": {"schema": {}}},
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
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(request)}}},
        "responses": responses,
    }


def _probe(summary: str) -> dict[str, Any]:
    return {
        "summary": summary,
        "responses": {
            "200": {"description": "Up.", "content": {JSON: {"schema": ref("Status")}}},
            "503": {"description": "Not up.", "content": {JSON: {"schema": ref("Status")}}},
        },
    }


LORA_STATUS: Schema = {
    "type": "object",
    "required": ["status", "message"],
    "properties": {"status": {"const": "ok"}, "message": {"type": "string"}},
}
LORA_NAME: Schema = {"type": "string", "minLength": 1}


def _lora_admin(summary: str, request: str, errors: dict[str, str]) -> dict[str, Any]:
    """vLLM's LoRA admin routes (`lora_routes`): a JSON body in, a status out."""
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {JSON: {"schema": ref(request)}}},
        "responses": {
            "200": {"description": "Done.", "content": {JSON: {"schema": ref("LoraStatus")}}},
            **{code: _error(text) for code, text in errors.items()},
        },
    }


def _lora_paths() -> dict[str, Any]:
    bad = "Malformed body, a name or folder that cannot be served (`param` names which)."
    return {
        "/v1/load_lora_adapter": {
            "post": _lora_admin(
                "Serve a PEFT LoRA adapter under `lora_name` (its weights load into a slot when "
                "a request first names it).",
                "LoadLoraAdapterRequest",
                {"400": bad + " A taken name, a rank over `--max-lora-rank`.", "413": "Too large."},
            )
        },
        "/v1/unload_lora_adapter": {
            "post": _lora_admin(
                "Stop serving an adapter (running requests finish with it).",
                "UnloadLoraAdapterRequest",
                {"400": bad, "404": "No such adapter (`param: lora_name`).", "413": "Too large."},
            )
        },
    }


LORA_SCHEMAS: Schema = {
    "LoadLoraAdapterRequest": {
        "type": "object",
        "required": ["lora_name", "lora_path"],
        "properties": {"lora_name": LORA_NAME, "lora_path": {"type": "string", "minLength": 1}},
    },
    "UnloadLoraAdapterRequest": {
        "type": "object",
        "required": ["lora_name"],
        "properties": {"lora_name": LORA_NAME},
    },
    "LoraStatus": LORA_STATUS,
}


def openapi_document(
    model_name: str, max_model_len: int, guarded: bool, lora: bool = False
) -> dict[str, Any]:
    """The document of one app; `guarded` when `/v1/*` needs the API key (bearer); `lora`
    when adapters are served (`--enable-lora`: the admin routes answer 400 otherwise, so they
    are documented only then)."""
    models: dict[str, Any] = {
        "summary": "The served model.",
        "responses": {
            "200": {"description": "One model.", "content": {JSON: {"schema": ref("Models")}}}
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
    if lora:
        doc["paths"].update(_lora_paths())
        doc["components"]["schemas"].update(LORA_SCHEMAS)
    if guarded:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in doc["paths"].items():
            if path.startswith("/v1/"):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}]
    return doc
