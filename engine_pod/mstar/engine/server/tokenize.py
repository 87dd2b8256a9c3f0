"""`/tokenize` and `/detokenize`, in vLLM's shapes.

`/tokenize` takes a `prompt` (with `add_special_tokens`, default true) or chat `messages`
(rendered with the template as a chat request would be, `add_generation_prompt` default
true, optional `tools`) and answers `{"count", "max_model_len", "tokens", "token_strs"}`;
`/detokenize` takes `tokens` and answers `{"prompt"}`. Bad bodies are 400s naming the field.

`GET /tokenizer_info` is vLLM's: the tokenizer's configuration (class, special tokens, chat
template, length). lm-evaluation-harness asks it first and, when it answers, tokenizes
through `/tokenize` and `/detokenize` instead of loading the model's name from a hub.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from mstar.engine.sampling_params import InvalidParameter
from mstar.engine.server.body import read_json_body
from mstar.engine.server.errors import APIError, bad_request, model_not_found
from mstar.engine.server.protocol import parse_messages
from mstar.engine.server.state import STATE
from mstar.engine.server.tools import parse_tools, template_messages


def _body(body: Any, model_name: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != model_name:
        raise model_not_found(str(model))
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def _render_chat(tok: Any, body: dict[str, Any]) -> str:
    messages = parse_messages(body.get("messages"))
    try:
        config = parse_tools({"tools": body.get("tools")})
    except InvalidParameter as exc:
        raise bad_request(str(exc), exc.param) from exc
    tools = config.prompt_tools() if config is not None else None
    native = "tools" in (getattr(tok, "chat_template", None) or "")
    extra = {"tools": tools} if tools and native else {}
    try:
        return str(
            tok.apply_chat_template(
                template_messages(messages, tools, native),
                add_generation_prompt=_flag(body, "add_generation_prompt", True),
                **extra,
            )
        )
    except Exception as exc:  # template errors are the conversation's fault
        raise bad_request(f"Cannot apply the chat template: {exc}", "messages") from exc


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _body(await read_json_body(request), state.model_name)
    tok = state.engine.tokenizer
    if "messages" in body:
        text = _render_chat(tok, body)
        special, param = _flag(body, "add_special_tokens", False), "messages"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        text = prompt
        special, param = _flag(body, "add_special_tokens", True), "prompt"
    try:
        ids = list(tok.encode(text, add_special_tokens=special))
    except Exception as exc:
        raise bad_request(f"Cannot tokenize the {param}: {exc}", param) from exc
    return web.json_response(
        {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": None}
    )


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _body(await read_json_body(request), state.model_name)
    tokens = body.get("tokens")
    vocab = state.engine.grammar.vocab_size
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
    ):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return web.json_response({"prompt": state.engine.tokenizer.decode(tokens)})


async def tokenizer_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    tok = state.engine.tokenizer
    specials = getattr(tok, "special_tokens", {})
    info: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": specials.get("bos_token"),
        "eos_token": specials.get("eos_token"),
        "pad_token": specials.get("pad_token"),
        "unk_token": specials.get("unk_token"),
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": state.max_model_len,
        "vocab_size": state.engine.grammar.vocab_size,
    }
    return web.json_response(info)
