"""The real server with the official `openai` client: completions, chat, streaming, n, logprobs.

Expected tokens come from a second engine instance on the same weights, run offline; the
server must return exactly those, whatever its batching did.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from live_server import LiveServer, make_engine

from mstar.kernels import cpu_isa

#: Greedy and never stopping at EOS, so lengths are exact.
EXTRA = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def words(ids: list[int]) -> list[str]:
    return [f"w{i}" for i in ids]


def ids_of(text: str) -> list[int]:
    return [int(w[1:]) for w in text.split()]


def test_probes_and_models(server: LiveServer, client: openai.OpenAI) -> None:
    status, body = server.get("/health")
    # the engine runs on CPU here: the kernels of this CPU's level (or MSTAR_CPU_ISA's)
    assert status == 200 and json.loads(body) == {
        "status": "ok",
        "cpu_isa": cpu_isa.chosen_level().name,
    }
    status, body = server.get("/ready")
    assert status == 200 and json.loads(body)["model"] == "tiny"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_matches_offline_greedy(client: openai.OpenAI, reference: Any) -> None:
    expected = reference([7, 8, 9], 6)
    out = client.completions.create(
        model="tiny", prompt="w7 w8 w9", max_tokens=6, temperature=0, extra_body=EXTRA
    )
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.choices[0].text.split() == words(expected)
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 6)
    assert out.usage.total_tokens == 9


def test_token_prompts_batch_and_streaming(client: openai.OpenAI, reference: Any) -> None:
    out = client.completions.create(
        model="tiny", prompt=[[7, 8, 9], [10, 11]], max_tokens=4, temperature=0, extra_body=EXTRA
    )
    assert [c.index for c in out.choices] == [0, 1]
    assert ids_of(out.choices[0].text) == reference([7, 8, 9], 4)
    assert ids_of(out.choices[1].text) == reference([10, 11], 4)
    assert out.usage is not None and out.usage.prompt_tokens == 5

    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=[10, 11],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            extra_body=EXTRA,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert ids_of(text) == reference([10, 11], 4)
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_uses_the_template_and_streams_the_same(
    client: openai.OpenAI, server: LiveServer, reference: Any
) -> None:
    messages: Any = [
        {"role": "system", "content": "w9"},
        {"role": "user", "content": "w10 w11"},
    ]
    # CHAT_TEMPLATE renders "w3 w9 w4 w3 w10 w11 w4 w5".
    prompt = [3, 9, 4, 3, 10, 11, 4, 5]
    expected = reference(prompt, 5)
    out = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=5, temperature=0, extra_body=EXTRA
    )
    assert out.object == "chat.completion"
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content is not None
    assert ids_of(msg.content) == expected
    assert out.usage is not None and out.usage.prompt_tokens == len(prompt)

    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_completion_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        temperature=0,
        extra_body=EXTRA,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert ids_of(content) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_n_choices_with_seed_are_distinct_and_reproducible(client: openai.OpenAI) -> None:
    def ask() -> list[str]:
        out = client.completions.create(
            model="tiny",
            prompt="w7 w8",
            n=4,
            max_tokens=8,
            temperature=1.0,
            seed=1234,
            extra_body={"ignore_eos": True},
        )
        assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
        assert out.usage is not None and out.usage.completion_tokens == 32
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = ask()
    assert ask() == first  # same seed, same choices
    assert len(set(first)) > 1  # choice i samples with seed + i


def test_completion_logprobs(client: openai.OpenAI, reference: Any) -> None:
    out = client.completions.create(
        model="tiny", prompt="w7 w8 w9", max_tokens=4, logprobs=3, temperature=0, extra_body=EXTRA
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.tokens == words(reference([7, 8, 9], 4))
    assert lp.top_logprobs is not None and lp.text_offset is not None
    for chosen, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0.0
        assert len(top) >= 3 and top[chosen] == value
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w10"}],
        max_completion_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
        extra_body=EXTRA,
    )
    content = out.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 3
    for entry in content.content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())


def test_stop_strings_and_stop_token_ids(client: openai.OpenAI, reference: Any) -> None:
    expected = words(reference([12, 13], 8))
    stop_at = next(i for i in range(2, 8) if expected[i] not in expected[:i])
    out = client.completions.create(
        model="tiny",
        prompt="w12 w13",
        max_tokens=8,
        stop=[expected[stop_at]],
        temperature=0,
        extra_body=EXTRA,
    )
    assert out.choices[0].text.split() == expected[:stop_at]
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == stop_at + 1

    out = client.completions.create(
        model="tiny",
        prompt="w12 w13",
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [int(expected[stop_at][1:])]},
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == stop_at + 1

    # Streaming never shows the stop string, even split across chunks.
    stream = client.completions.create(
        model="tiny",
        prompt="w12 w13",
        max_tokens=8,
        stop=[" ".join(expected[stop_at - 1 : stop_at + 1])],
        stream=True,
        temperature=0,
        extra_body=EXTRA,
    )
    text = "".join(c.choices[0].text for c in stream)
    assert text.split() == expected[: stop_at - 1]


def raw(server: LiveServer, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        server.url + path,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


ERRORS: list[tuple[str, Any, int, str | None]] = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", {"model": "nope", "prompt": "w1"}, 404, "model"),
    ("/v1/completions", {"prompt": "w1", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "w1", "temperature": 9}, 400, "temperature"),
    ("/v1/completions", {"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "w1", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "w1", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": [1, 2, 500]}, 400, "prompt"),  # id outside the vocabulary
    ("/v1/completions", {"prompt": "w1 " * 600}, 400, "prompt"),  # longer than the context
    ("/v1/completions", {"prompt": "w1", "max_tokens": 100000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "x", "content": "a"}]}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "w1 " * 600}]},
        400,
        "messages",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    ("/v1/nothing", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERRORS)
def test_errors_are_openai_shaped(
    server: LiveServer, path: str, body: Any, status: int, param: str | None
) -> None:
    code, payload, _ = raw(server, path, body)
    assert code == status
    err = payload["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_errors_leave_no_pages_and_count_nothing(tiny_chat_dir: Path) -> None:
    """Requests the engine admits and then refuses for good (`AdmitRuntimeError`: 80 prompt
    tokens never fit 12 pages of 4) answer 400 naming the prompt, streamed or not; they are
    counted as errors, produce no tokens, hold no page, and the server serves on."""
    with LiveServer(make_engine(tiny_chat_dir, num_pages=12)) as live:
        long = " ".join(f"w{3 + i % 90}" for i in range(80))
        tokens = live.metric("mstar:generation_tokens_total")
        bodies: list[tuple[str, dict[str, Any]]] = [
            ("/v1/completions", {"prompt": long, "max_tokens": 4}),
            ("/v1/completions", {"prompt": long, "max_tokens": 4, "stream": True}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": long}], "stream": True},
            ),
        ]
        results = [raw(live, path, body)[:2] for path, body in bodies]
        assert [s for s, _ in results] == [400, 400, 400]
        assert [b["error"]["param"] for _, b in results] == ["prompt", "prompt", "messages"]
        assert "KV pages" in results[0][1]["error"]["message"]
        refused = live.metric(
            "mstar:admit_failures_total", reason="AdmitRuntimeError", resource="kv"
        )
        assert refused == 3  # they did reach the engine
        assert live.metric("mstar:request_success_total", finished_reason="error") == 3
        assert live.metric("mstar:generation_tokens_total") == tokens
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)
        status, body, _ = raw(live, "/v1/completions", {"prompt": "w7 w8", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        live.wait_metric("mstar:kv_cache_usage_perc", 0.0)


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="w1", temperature=5)
    assert "temperature" in str(info.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="w1")


def test_echo_prepends_the_prompt(client: openai.OpenAI, reference: Any) -> None:
    out = client.completions.create(
        model="tiny", prompt="w7 w8 w9", max_tokens=3, echo=True, temperature=0, extra_body=EXTRA
    )
    assert out.choices[0].text.split() == ["w7", "w8", "w9", *words(reference([7, 8, 9], 3))]
