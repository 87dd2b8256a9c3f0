"""Prompt logprobs through the official `openai` client, as scoring clients ask for them:
OpenAI's `echo` + `logprobs` on completions (streamed and not) and vLLM's `prompt_logprobs`
(completions and chat), each value equal to transformers' log-softmax over the prompt
(float32 tiny model, 1e-4); `/tokenizer_info` in vLLM's shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from live_server import LiveServer

PROMPT = [7, 8, 9, 30, 31, 12, 40]
TOL = 1e-4


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x")


@pytest.fixture(scope="module")
def hf(tiny_chat_dir: Path) -> Any:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_chat_dir, dtype=torch.float32)

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


def _want(hf: Any, ids: list[int]) -> list[float]:
    lp = hf(ids)
    return [float(lp[p - 1, ids[p]]) for p in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt(client: openai.OpenAI, hf: Any) -> None:
    """lm-eval's loglikelihood request: prompt ids, echo, logprobs 1, max_tokens 1."""
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == [f"w{t}" for t in PROMPT] + lp.tokens[len(PROMPT) :]
    assert len(lp.tokens) == len(PROMPT) + 1  # the prompt, then the generated token
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1 : len(PROMPT)] == pytest.approx(_want(hf, PROMPT), abs=TOL)
    for i, top in enumerate(lp.top_logprobs[1:], start=1):
        assert top is not None and lp.tokens[i] in top and 2 <= len(top) <= 3
        assert max(top.values()) >= lp.token_logprobs[i] - TOL  # type: ignore[operator]
    offsets = lp.text_offset or []
    assert offsets == sorted(offsets) and offsets[-1] < len(choice.text)
    for i, token in enumerate(lp.tokens[: len(PROMPT)]):
        assert choice.text[offsets[i] :].lstrip().startswith(token)


def test_echo_streamed_matches_the_whole_answer(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model="tiny", prompt="w7 w8 w9", max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    whole = client.completions.create(**args).choices[0]
    chunks = list(client.completions.create(stream=True, **args))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.text
    first = next(c.choices[0] for c in chunks if c.choices)
    assert first.text.startswith("w7 w8 w9")
    assert first.logprobs is not None and first.logprobs.token_logprobs is not None
    assert first.logprobs.token_logprobs[0] is None
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens or []
    ]
    assert tokens == whole.logprobs.tokens  # type: ignore[union-attr]


def _check_vllm(entries: list[Any], ids: list[int], hf: Any, k: int) -> None:
    assert entries[0] is None and len(entries) == len(ids)
    for entry, token, want in zip(entries[1:], ids[1:], _want(hf, ids), strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(want, abs=TOL)
        assert entry[str(token)]["rank"] >= 1
        assert entry[str(token)]["decoded_token"] == f"w{token}"
        assert k <= len(entry) <= k + 1


def test_vllm_prompt_logprobs_on_both_routes(
    client: openai.OpenAI, server: LiveServer, hf: Any
) -> None:
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 3}
    )
    _check_vllm(out.choices[0].model_extra["prompt_logprobs"], PROMPT, hf, 3)  # type: ignore[index]
    assert out.choices[0].logprobs is None  # generated logprobs were not asked for
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "w20 w21 w22"}],
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 0},
    )
    status, body = server.get("/tokenizer_info")
    ids = client.post(
        "/../tokenize",
        body={"messages": [{"role": "user", "content": "w20 w21 w22"}]},
        cast_to=object,
    )["tokens"]  # type: ignore[index]
    _check_vllm(chat.model_extra["prompt_logprobs"], ids, hf, 0)  # type: ignore[index]
    info = json.loads(body)
    assert status == 200
    assert info["eos_token"] == "w2" and info["bos_token"] == "w1"
    assert "w3" in info["chat_template"] and info["model_max_length"] > len(PROMPT)


def test_bad_prompt_logprobs_is_a_400(client: openai.OpenAI) -> None:
    for value in (21, -1, "3", True):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="tiny", prompt="w1", extra_body={"prompt_logprobs": value}
            )
        assert info.value.body["param"] == "prompt_logprobs"  # type: ignore[index]
