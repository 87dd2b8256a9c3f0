"""OpenAI request parsing and validation (errors: `errors`; reading the body: `body`).

Every check happens here, before anything reaches the engine, so a bad request is answered
with a 4xx naming the offending parameter instead of failing deep inside a step. The parsed
request keeps what the server itself acts on (prompts, `n`, stop strings, streaming, logprob
shape) next to the engine's `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from mstar.engine.sampling_params import (
    InvalidParameter,
    SamplingParams,
    context_overflow,
)
from mstar.engine.server.errors import APIError, bad_request
from mstar.engine.server.scoring import parse_prompt_logprobs
from mstar.engine.server.structured import parse_response_format, request_grammar
from mstar.engine.server.tools import ToolConfig, parse_tools

#: Most choices one request may ask for (OpenAI's own limit for chat).
MAX_N = 128
#: Most top alternatives per token (OpenAI: 20 for chat; vLLM's default max_logprobs).
MAX_TOP_LOGPROBS = SamplingParams.MAX_LOGPROBS
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
INT64 = 2**63


# -- typed getters -------------------------------------------------------------------------------


def _type_error(name: str, expected: str, value: Any) -> APIError:
    return bad_request(f"'{name}' must be {expected}, got {type(value).__name__}", name)


def _get_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _get_int(
    body: dict[str, Any],
    name: str,
    default: int | None,
    lo: int | None = None,
    hi: int | None = None,
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # JSON has one number type; 3.0 is accepted as 3, as pydantic does for OpenAI's server.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if lo is not None and value < lo:
        raise bad_request(f"'{name}' must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise bad_request(f"'{name}' must be <= {hi}, got {value}", name)
    return value


def _get_float(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _type_error(name, "a number", value)
    try:
        number = float(value)  # an integer past the float range overflows
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"'{name}' must be a finite number", name)
    return number


def _get_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return value


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


# -- parsed requests -----------------------------------------------------------------------------

Prompt = str | list[int]


@dataclass
class GenerationRequest:
    """What the server needs from a completion or chat request, validated.

    `max_tokens=None` means "up to the context"; the handler resolves it once the prompt's
    length is known (see `resolve_max_tokens`). `top_logprobs` is the number of alternatives
    per token and is `None` when logprobs were not asked for.
    """

    kind: Literal["completion", "chat"]
    model: str | None
    #: Completions: one entry per prompt. Chat: a single rendered conversation (set later).
    prompts: list[Prompt]
    messages: list[dict[str, Any]] = field(default_factory=list)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    top_logprobs: int | None = None
    echo: bool = False
    params: SamplingParams = field(default_factory=SamplingParams)
    #: Chat only: the declared tools and how they may be called.
    tools: ToolConfig | None = None
    #: vLLM's `prompt_logprobs` was asked for (its field in the response).
    vllm_prompt_logprobs: bool = False

    @property
    def prompt_param(self) -> str:
        """Which request field holds the prompt, for error bodies."""
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.kind == "chat" else "max_tokens"

    def sampling_params(self, prompt_len: int, max_model_len: int, choice: int) -> SamplingParams:
        """Engine parameters for one choice of one prompt.

        With a seed, choice `i` uses `seed + i`: choices differ from one another, yet the whole
        response is reproducible.
        """
        max_tokens = resolve_max_tokens(self, prompt_len, max_model_len)
        seed = self.params.seed
        if seed is not None and choice:
            seed = (seed + choice + INT64) % (2 * INT64) - INT64
        try:
            return dataclasses.replace(self.params, max_tokens=max_tokens, seed=seed)
        except InvalidParameter as exc:  # e.g. min_tokens past the budget the context leaves
            raise bad_request(str(exc), exc.param) from exc


def resolve_max_tokens(req: GenerationRequest, prompt_len: int, max_model_len: int) -> int:
    """The completion budget, refusing (400) what cannot fit in the context."""
    if prompt_len == 0:
        raise bad_request("The prompt is empty.", req.prompt_param)
    max_tokens = max_model_len - prompt_len if req.max_tokens is None else req.max_tokens
    over = context_overflow(prompt_len, max_tokens, max_model_len, req.prompt_param)
    if over is not None:
        blamed, message = over
        param = req.max_tokens_param if blamed == "max_tokens" else req.prompt_param
        raise bad_request(message, param, code="context_length_exceeded")
    return max_tokens


def _parse_stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad_request("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in stop):
        raise bad_request("'stop' strings must not be empty", "stop")
    return list(dict.fromkeys(stop))


def _parse_stop_token_ids(body: dict[str, Any]) -> list[int]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return []
    if not _is_token_list(ids):
        raise bad_request("'stop_token_ids' must be a list of integers", "stop_token_ids")
    return list(ids)


def _parse_logit_bias(body: dict[str, Any]) -> dict[int, float]:
    """OpenAI's map of token id (as a JSON key, a string) -> bias in [-100, 100]."""
    raw = body.get("logit_bias")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _type_error("logit_bias", "an object", raw)
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not key.isdigit() or not key.isascii():
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        value = raw[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad_request(f"'logit_bias' values must be numbers, got {value!r}", "logit_bias")
        bias[int(key)] = float(value) if abs(value) < 1e300 else math.inf  # range: checked next
    return bias


def _common(body: dict[str, Any], kind: Literal["completion", "chat"]) -> dict[str, Any]:
    """Fields shared by both routes; returns GenerationRequest keyword arguments."""
    model = _get_str(body, "model")
    n = _get_int(body, "n", 1, 1, MAX_N)
    assert n is not None
    stream = _get_bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise bad_request(
                "'stream_options' is only allowed when 'stream' is true", "stream_options"
            )
        if not isinstance(stream_options, dict):
            raise _type_error("stream_options", "an object", stream_options)
        include_usage = _get_bool(stream_options, "include_usage", False)
    if kind == "chat":
        # `max_tokens` is the deprecated spelling: checked too, used only when alone.
        legacy = _get_int(body, "max_tokens", None, 1)
        max_tokens = _get_int(body, "max_completion_tokens", None, 1)
        if max_tokens is None:
            max_tokens = legacy
    else:
        max_tokens = _get_int(body, "max_tokens", 16, 1)
    best_of = _get_int(body, "best_of", None, 1)
    if best_of is not None and best_of != n:
        raise bad_request("'best_of' other than 'n' is not supported", "best_of")
    min_tokens = _get_int(body, "min_tokens", 0, 0)
    assert min_tokens is not None
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(
            f"'min_tokens' ({min_tokens}) must not exceed the maximum ({max_tokens})", "min_tokens"
        )
    seed = _get_int(body, "seed", None, -INT64, INT64 - 1)
    top_k = _get_int(body, "top_k", 0, -1)
    assert top_k is not None
    try:
        params = SamplingParams(
            max_tokens=max(1, min_tokens),
            temperature=_get_float(body, "temperature", 1.0),
            top_p=_get_float(body, "top_p", 1.0),
            top_k=top_k,
            min_p=_get_float(body, "min_p", 0.0),
            seed=seed,
            repetition_penalty=_get_float(body, "repetition_penalty", 1.0),
            presence_penalty=_get_float(body, "presence_penalty", 0.0),
            frequency_penalty=_get_float(body, "frequency_penalty", 0.0),
            stop_token_ids=_parse_stop_token_ids(body),
            ignore_eos=_get_bool(body, "ignore_eos", False),
            min_tokens=min_tokens,
            logit_bias=_parse_logit_bias(body),
            grammar=parse_response_format(body),
        )
    except InvalidParameter as exc:
        raise bad_request(str(exc), exc.param) from exc
    return {
        "kind": kind,
        "model": model,
        "n": n,
        "stream": stream,
        "include_usage": include_usage,
        "max_tokens": max_tokens,
        "stop": _parse_stop(body),
        "include_stop_str_in_output": _get_bool(body, "include_stop_str_in_output", False),
        "skip_special_tokens": _get_bool(body, "skip_special_tokens", True),
        "params": params,
    }


def _with_logprobs(kwargs: dict[str, Any], top: int | None) -> GenerationRequest:
    req = GenerationRequest(prompts=[], **kwargs)
    req.top_logprobs = top
    req.params = dataclasses.replace(req.params, logprobs=top)
    return req


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def parse_completion_request(body: Any) -> GenerationRequest:
    """Validate a `/v1/completions` body."""
    body = _require_object(body)
    kwargs = _common(body, "completion")
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    echo = _get_bool(body, "echo", False)
    top = _get_int(body, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    req = _with_logprobs(kwargs, top)
    req.echo = echo
    _score_prompt(req, body, top if echo else None)
    req.prompts = _parse_prompts(body.get("prompt"))
    return req


def _parse_prompts(prompt: Any) -> list[Prompt]:
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if _is_token_list(prompt):
            return [list(prompt)]
        if all(_is_token_list(p) and p for p in prompt):
            return [list(p) for p in prompt]
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of lists "
        "of token ids, and not empty",
        "prompt",
    )


def parse_chat_request(body: Any) -> GenerationRequest:
    """Validate a `/v1/chat/completions` body."""
    body = _require_object(body)
    kwargs = _common(body, "chat")
    want = _get_bool(body, "logprobs", False)
    top = _get_int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if top is not None and not want:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    req = _with_logprobs(kwargs, (top or 0) if want else None)
    req.messages = parse_messages(body.get("messages"))
    _score_prompt(req, body, None)
    if req.stream and req.vllm_prompt_logprobs:  # a response-level field: vLLM refuses it too
        raise bad_request("'prompt_logprobs' is not available when streaming chat", "stream")
    try:
        req.tools = parse_tools(body)
    except InvalidParameter as exc:
        raise bad_request(str(exc), exc.param) from exc
    grammar = request_grammar(req.params.grammar, req.tools)
    req.params = dataclasses.replace(req.params, grammar=grammar)
    return req


def _score_prompt(req: GenerationRequest, body: dict[str, Any], echo_top: int | None) -> None:
    """Prompt logprobs (`scoring`): OpenAI's echo + logprobs, vLLM's `prompt_logprobs`."""
    try:
        k = parse_prompt_logprobs(body, echo_top)
    except InvalidParameter as exc:
        raise bad_request(str(exc), exc.param) from exc
    req.vllm_prompt_logprobs = body.get("prompt_logprobs") is not None
    req.params = dataclasses.replace(req.params, prompt_logprobs=k)


def parse_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object", "messages")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(sorted(CHAT_ROLES))}", "messages"
            )
        content = message.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad_request(f"'{where}.content' parts must be text parts", "messages")
                if not isinstance(part.get("text"), str):
                    raise bad_request(f"'{where}.content' text must be a string", "messages")
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise bad_request(f"'{where}.content' must be a string or a list", "messages")
        entry: dict[str, Any] = {"role": role, "content": text}
        for key in ("name", "tool_call_id"):
            value = message.get(key)
            if value is not None:
                if not isinstance(value, str):
                    raise bad_request(f"'{where}.{key}' must be a string", "messages")
                entry[key] = value
        calls = message.get("tool_calls")
        if calls is not None and calls != []:
            if role != "assistant":
                raise bad_request(
                    f"'{where}.tool_calls' is only for assistant messages", "messages"
                )
            entry["tool_calls"] = _parse_message_calls(calls, where)
        out.append(entry)
    return out


def _parse_message_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's earlier `tool_calls`, kept in OpenAI's shape for the template."""
    if not isinstance(calls, list):
        raise bad_request(f"'{where}.tool_calls' must be a list", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not isinstance(fn.get("arguments"), str)
        ):
            raise bad_request(
                f"'{where}.tool_calls[{j}]' must be {{'id', 'type': 'function', "
                "'function': {'name', 'arguments': string}}",
                "messages",
            )
        call_id = call.get("id", f"call_{j}")
        if not isinstance(call_id, str) or call.get("type", "function") != "function":
            raise bad_request(
                f"'{where}.tool_calls[{j}]' needs a string 'id' and 'type': 'function'", "messages"
            )
        entry = {
            "id": call_id,
            "type": "function",
            "function": {"name": fn["name"], "arguments": fn["arguments"]},
        }
        out.append(entry)
    return out
