"""instructor 1.17 (installed by scripts/test.sh without its jiter pin) against the live server
on the real SmolLM2, unchanged, in the two modes its users pick for OpenAI-compatible servers:
JSON_SCHEMA (`response_format`) and TOOLS (a forced `tool_choice`). Retries are off, so a reply
the library cannot validate fails the test instead of being retried away.

The model is small: the tests judge the protocol (a validated model comes back), not the answer.
"""

from __future__ import annotations

import instructor
import openai
import pytest
from live_server import LiveServer
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str


@pytest.mark.parametrize("mode", [instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS])
def test_instructor_returns_a_validated_model(smol: LiveServer, mode: instructor.Mode) -> None:
    client = instructor.from_openai(
        openai.OpenAI(base_url=smol.url + "/v1", api_key="x"), mode=mode
    )
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL,
        response_model=City,
        messages=[{"role": "user", "content": "Name a city in France."}],
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(city, City) and city.name and city.country
    (choice,) = completion.choices
    if mode == instructor.Mode.TOOLS:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "City"
    else:
        assert choice.finish_reason == "stop" and choice.message.content
