"""Request validation: every bad input is a 400 naming its parameter; good input parses exactly."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mstar.engine.sampling_params import (
    FLOAT_BOUNDS,
    InvalidParameter,
    SamplingParams,
    context_overflow,
)
from mstar.engine.server.body import MAX_JSON_DEPTH, decode_json_body
from mstar.engine.server.errors import APIError
from mstar.engine.server.openapi import openapi_document
from mstar.engine.server.protocol import (
    MAX_N,
    parse_chat_request,
    parse_completion_request,
    resolve_max_tokens,
)

CHAT = [{"role": "user", "content": "hi"}]


def comp(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hello", **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": CHAT, **kw}


def error_of(fn: Any, body: Any) -> APIError:
    with pytest.raises(APIError) as info:
        fn(body)
    err = info.value
    assert err.status == 400
    body_ = err.body()["error"]
    assert set(body_) == {"message", "type", "param", "code"}
    assert body_["type"] == "invalid_request_error"
    assert body_["message"]
    return err


BAD_COMPLETIONS: list[tuple[dict[str, Any], str | None]] = [
    (comp(prompt=None), "prompt"),
    (comp(prompt=[]), "prompt"),
    (comp(prompt=5), "prompt"),
    (comp(prompt=[1, "a"]), "prompt"),
    (comp(prompt=[[1, 2], []]), "prompt"),
    (comp(prompt=[True, 2]), "prompt"),
    (comp(max_tokens=0), "max_tokens"),
    (comp(max_tokens="5"), "max_tokens"),
    (comp(max_tokens=2.5), "max_tokens"),
    (comp(max_tokens=True), "max_tokens"),
    (comp(n=0), "n"),
    (comp(n=MAX_N + 1), "n"),
    (comp(n="2"), "n"),
    (comp(temperature=-0.1), "temperature"),
    (comp(temperature=2.5), "temperature"),
    (comp(temperature="hot"), "temperature"),
    (comp(temperature=float("nan")), "temperature"),
    (comp(top_p=0), "top_p"),
    (comp(top_p=1.5), "top_p"),
    (comp(top_k=-2), "top_k"),
    (comp(top_k=1.5), "top_k"),
    (comp(min_p=1.1), "min_p"),
    (comp(min_p=-0.1), "min_p"),
    (comp(presence_penalty=2.1), "presence_penalty"),
    (comp(frequency_penalty=-2.1), "frequency_penalty"),
    (comp(repetition_penalty=0), "repetition_penalty"),
    (comp(repetition_penalty=3), "repetition_penalty"),
    (comp(logprobs=21), "logprobs"),
    (comp(logprobs=-1), "logprobs"),
    (comp(logprobs=True), "logprobs"),
    (comp(stop=5), "stop"),
    (comp(stop=["a", 1]), "stop"),
    (comp(stop=[""]), "stop"),
    (comp(stop_token_ids=[1, "x"]), "stop_token_ids"),
    (comp(stop_token_ids=[-1]), "stop_token_ids"),
    (comp(seed="x"), "seed"),
    (comp(seed=2**64), "seed"),
    (comp(stream="yes"), "stream"),
    (comp(stream_options={"include_usage": True}), "stream_options"),
    (comp(stream=True, stream_options=[1]), "stream_options"),
    (comp(stream=True, stream_options={"include_usage": "y"}), "include_usage"),
    (comp(model=3), "model"),
    (comp(best_of=3), "best_of"),
    (comp(logit_bias={"5": 101}), "logit_bias"),
    (comp(logit_bias=[1]), "logit_bias"),
    (comp(logit_bias=0), "logit_bias"),
    (comp(temperature=10**400), "temperature"),
    (comp(suffix="x"), "suffix"),
    (comp(prompt_logprobs=21), "prompt_logprobs"),
    (comp(prompt_logprobs=True), "prompt_logprobs"),
    (comp(ignore_eos="no"), "ignore_eos"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_names_param(body: dict[str, Any], param: str) -> None:
    assert error_of(parse_completion_request, body).param == param


BAD_CHATS: list[tuple[Any, str | None]] = [
    (chat(messages=None), "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[{"role": "robot", "content": "x"}]), "messages"),
    (chat(messages=[{"content": "x"}]), "messages"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (chat(messages=["x"]), "messages"),
    (chat(max_completion_tokens=0), "max_completion_tokens"),
    (chat(max_tokens=-3), "max_tokens"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(logprobs=3), "logprobs"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(tools=0), "tools"),
    (chat(messages=[{"role": {}, "content": "x"}]), "messages"),
    (chat(messages=[{"role": "user", "content": "x", "name": 5}]), "messages"),
    (chat(max_tokens="3", max_completion_tokens=4), "max_tokens"),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(temperature=3), "temperature"),
    ([1, 2], None),
    ("text", None),
]


@pytest.mark.parametrize(("body", "param"), BAD_CHATS)
def test_bad_chat_names_param(body: Any, param: str | None) -> None:
    assert error_of(parse_chat_request, body).param == param


def test_completion_defaults_and_values() -> None:
    req = parse_completion_request(comp())
    assert req.prompts == ["hello"]
    assert (req.n, req.stream, req.max_tokens, req.top_logprobs) == (1, False, 16, None)
    assert req.params.temperature == 1.0 and req.params.logprobs is None

    req = parse_completion_request(
        comp(
            prompt=[[1, 2], [3]],
            n=3,
            max_tokens=7,
            temperature=0,
            top_p=0.5,
            top_k=4,
            min_p=0.1,
            seed=11,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            repetition_penalty=1.2,
            logprobs=2,
            stop="\n",
            stop_token_ids=[9],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens_unknown_field="ignored",
        )
    )
    assert req.prompts == [[1, 2], [3]]
    assert req.n == 3 and req.max_tokens == 7 and req.stop == ["\n"]
    assert req.stream and req.include_usage and req.top_logprobs == 2
    p = req.params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.0, 0.5, 4, 0.1, 11)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.logprobs == 2 and p.stop_token_ids == [9] and p.greedy
    assert parse_completion_request(comp(prompt=[5, 6])).prompts == [[5, 6]]
    assert parse_completion_request(comp(prompt=["a", "b"])).prompts == ["a", "b"]
    assert parse_completion_request(comp(max_tokens=4.0)).max_tokens == 4


def test_chat_values() -> None:
    req = parse_chat_request(
        chat(
            messages=[
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
            ],
            max_tokens=5,
            max_completion_tokens=9,
            logprobs=True,
            top_logprobs=3,
        )
    )
    assert req.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": ""},
    ]
    assert req.max_tokens == 9  # max_completion_tokens wins over the deprecated max_tokens
    assert req.top_logprobs == 3 and req.params.logprobs == 3
    assert req.max_tokens_param == "max_completion_tokens" and req.prompt_param == "messages"
    assert parse_chat_request(chat(logprobs=True)).top_logprobs == 0
    assert parse_chat_request(chat()).top_logprobs is None
    assert parse_chat_request(chat()).max_tokens is None  # up to the context


def test_context_limits() -> None:
    req = parse_completion_request(comp(max_tokens=10))
    assert resolve_max_tokens(req, 5, 100) == 10
    with pytest.raises(APIError) as info:
        resolve_max_tokens(req, 95, 100)
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as info:
        resolve_max_tokens(req, 100, 100)
    assert info.value.param == "prompt"
    chat_req = parse_chat_request(chat())
    assert resolve_max_tokens(chat_req, 30, 100) == 70
    with pytest.raises(APIError) as info:
        resolve_max_tokens(chat_req, 120, 100)
    assert info.value.param == "messages"


def test_seed_per_choice_is_distinct_and_reproducible() -> None:
    req = parse_completion_request(comp(seed=7, n=3))
    seeds = [req.sampling_params(3, 100, i).seed for i in range(3)]
    assert seeds == [7, 8, 9]
    top = parse_completion_request(comp(seed=2**63 - 1, n=2))
    assert top.sampling_params(3, 100, 1).seed == -(2**63)  # wraps, stays in int64
    assert parse_completion_request(comp(n=2)).sampling_params(3, 100, 1).seed is None


@given(
    temperature=st.floats(allow_nan=False, allow_infinity=False, min_value=-5, max_value=5),
    top_p=st.floats(allow_nan=False, allow_infinity=False, min_value=-1, max_value=2),
)
def test_floats_accepted_iff_in_range(temperature: float, top_p: float) -> None:
    ok = 0.0 <= temperature <= 2.0 and 0.0 < top_p <= 1.0
    body = comp(temperature=temperature, top_p=top_p)
    if ok:
        parse_completion_request(body)
    else:
        err = error_of(parse_completion_request, body)
        assert err.param == ("temperature" if not 0.0 <= temperature <= 2.0 else "top_p")


def body_error(raw: bytes, charset: str | None = None) -> APIError:
    with pytest.raises(APIError) as info:
        decode_json_body(raw, charset)
    assert info.value.status == 400 and info.value.message
    return info.value


def test_body_gate_turns_every_malformed_body_into_a_400() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # past the recursion limit
    assert "nested deeper" in body_error(deep).message
    shallow_enough_to_parse = b'{"prompt": ' + b"[" * 200 + b"]" * 200 + b"}"
    err = body_error(shallow_enough_to_parse)
    assert f"deeper than {MAX_JSON_DEPTH}" in err.message and err.param == "prompt"
    assert "digits" in body_error(b'{"n": ' + b"9" * 5000 + b"}").message
    assert "not valid JSON" in body_error(b'{"temperature": NaN}').message
    assert "unknown encoding" in body_error(b"{}", "nope").message
    assert body_error(b"{}", "base64").message  # a codec, but not a text encoding
    assert body_error(b"{}", "utf\x00").message
    assert body_error(b"\xff{}", "utf-8").message
    err = body_error(b'{"prompt": ["w1", "\\ud800"]}')
    assert err.param == "prompt" and "surrogate" in err.message
    err = body_error(b'{"messages": [{"role": "user", "content": "\\udfff"}]}')
    assert err.param == "messages"
    assert body_error(b'{"\\ud800": 1}').param is None


def test_body_gate_passes_good_bodies_through() -> None:
    assert decode_json_body(b'{"prompt": "caf\xc3\xa9 \\ud83d\\ude00"}', None) == {
        "prompt": "caf\u00e9 \U0001f600"  # a surrogate *pair* is one valid character
    }
    assert decode_json_body('{"prompt": "é"}'.encode("latin-1"), "ISO-8859-1") == {"prompt": "é"}
    nested = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_json_body(nested, "utf-8")["a"]


@pytest.mark.parametrize("name", list(FLOAT_BOUNDS))
def test_the_published_range_is_the_range_checked(name: str) -> None:
    bound = FLOAT_BOUNDS[name]
    schemas = openapi_document("m", 100, guarded=False)["components"]["schemas"]
    for route in ("CompletionRequest", "ChatCompletionRequest"):
        schema = schemas[route]["properties"][name]
        assert schema["maximum"] == bound.hi
        assert schema["exclusiveMinimum" if bound.lo_open else "minimum"] == bound.lo
    SamplingParams(**{name: bound.hi})
    with pytest.raises(InvalidParameter, match=name):
        SamplingParams(**{name: bound.hi + 0.5})
    if bound.lo_open:
        with pytest.raises(InvalidParameter, match=name):
            SamplingParams(**{name: bound.lo})
    else:
        SamplingParams(**{name: bound.lo})
        with pytest.raises(InvalidParameter, match=name):
            SamplingParams(**{name: bound.lo - 0.5})


def test_engine_and_server_refuse_a_long_context_with_one_message() -> None:
    blamed, message = context_overflow(30, 10, 32) or ("", "")
    assert blamed == "max_tokens" and "maximum context length is 32" in message
    req = parse_completion_request(comp(max_tokens=10))
    with pytest.raises(APIError) as info:
        resolve_max_tokens(req, 30, 32)
    assert info.value.message == message
    assert context_overflow(32, 1, 32) == (
        "prompt",
        "This model's maximum context length is 32 tokens. However, your prompt has 32 "
        "tokens, leaving no room for a completion.",
    )
    assert context_overflow(22, 10, 32) is None


def test_echo_with_logprobs_scores_the_prompt() -> None:
    """lm-eval's loglikelihood body: echo + logprobs asks the engine for prompt logprobs; vLLM's
    `prompt_logprobs` is the same request in its words (the larger k wins)."""
    req = parse_completion_request(comp(echo=True, logprobs=1, max_tokens=1))
    assert req.params.prompt_logprobs == 1 and not req.vllm_prompt_logprobs
    req = parse_completion_request(comp(prompt_logprobs=3, echo=True, logprobs=1))
    assert req.params.prompt_logprobs == 3 and req.vllm_prompt_logprobs
    assert parse_completion_request(comp(logprobs=2)).params.prompt_logprobs is None
    chat = {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 1}
    assert parse_chat_request(chat).params.prompt_logprobs == 1
    assert error_of(parse_chat_request, {**chat, "stream": True}).param == "stream"
