"""The README's main command on the real default model: SmolLM2 behind the OpenAI client."""

from __future__ import annotations

import openai
import pytest
from live_server import LiveServer
from openai.types.chat import ChatCompletionUserMessageParam

pytestmark = pytest.mark.slow


def test_chat_answers_and_streams_identically(smol: LiveServer) -> None:
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    assert model == "SmolLM2-135M-Instruct"
    messages = [
        ChatCompletionUserMessageParam(role="user", content="What is the capital of France?")
    ]
    out = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=24,
        temperature=0,
    )
    text = out.choices[0].message.content or ""
    assert "Paris" in text
    assert out.choices[0].finish_reason == "stop"  # the model's own end-of-turn token
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_completion_tokens=24,
        temperature=0,
        stream=True,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text
    smol.wait_metric("mstar:num_requests_running", 0.0, model_name=model)
