"""Agent SDKs (pinned in the test extras) against the live server on the real SmolLM2,
unchanged: openai-agents with an `output_type` and a required tool, pydantic-ai's default
`ToolOutput`, and langchain-openai's structured output and tool binding as regression guards.

The model is small: the tests judge the protocol (the SDK accepts every reply, calls come back
as `tool_calls`, outputs validate), not the answers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from live_server import LiveServer
from pydantic import BaseModel

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str
    country: str


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "City", "schema": City.model_json_schema(), "strict": True},
}


def _tool_calls_counted(live: LiveServer) -> float:
    return live.metric(
        "mstar:request_success_total", model_name=MODEL, finished_reason="tool_calls"
    )


def test_response_format_with_a_forced_or_auto_tool_choice(smol: LiveServer) -> None:
    """What the agent SDKs send: a format and a forced choice (the call now), a format and
    auto (a call or the format's content, nothing else)."""
    client = openai.OpenAI(base_url=smol.url + "/v1", api_key="x")
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    before = _tool_calls_counted(smol)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            response_format=CITY_FORMAT,  # type: ignore[arg-type]
            max_tokens=60,
            temperature=0,
        )
        (c,) = out.choices
        assert c.finish_reason == "tool_calls" and c.message.tool_calls
        call = c.message.tool_calls[0]
        assert call.function.name == "get_weather"  # type: ignore[union-attr]
        assert isinstance(json.loads(call.function.arguments)["city"], str)  # type: ignore[union-attr]
    assert _tool_calls_counted(smol) == before + 2
    for seed in range(3):
        out = client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            response_format=CITY_FORMAT,  # type: ignore[arg-type]
            max_tokens=80,
            temperature=0.8,
            seed=seed,
        )
        message = out.choices[0].message
        if message.tool_calls:
            assert out.choices[0].finish_reason == "tool_calls"
            assert message.tool_calls[0].function.name == "get_weather"  # type: ignore[union-attr]
        else:
            assert out.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(message.content or ""), City.model_json_schema())


def test_openai_agents_output_type_with_a_required_tool(smol: LiveServer) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        ToolCallItem,
        function_tool,
        set_tracing_disabled,
    )
    from agents.exceptions import MaxTurnsExceeded

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=smol.url + "/v1", api_key="x")
    agent = Agent(
        name="weather",
        instructions="Answer with the city.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        tools=[get_weather],
        output_type=City,
        model_settings=ModelSettings(tool_choice="required", max_tokens=120, temperature=0),
    )
    before = _tool_calls_counted(smol)
    try:
        result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=6))
    except MaxTurnsExceeded:
        # After its tool ran the SDK turns the choice to auto (with the format): greedy, this
        # model keeps calling the tool. Every reply was still accepted and every call ran.
        assert len(calls) >= 5
    else:
        assert isinstance(result.final_output, City)
        assert any(isinstance(item, ToolCallItem) for item in result.new_items)
    assert calls and all(isinstance(c, str) for c in calls)
    assert _tool_calls_counted(smol) >= before + len(calls)


def test_pydantic_ai_default_tool_output(smol: LiveServer) -> None:
    """pydantic-ai's default `ToolOutput`: `tool_choice` required over two output tools
    (`final_result_City`, `final_result_Country`) with `parallel_tool_calls` unset. Unbounded,
    greedy SmolLM2 repeated its call until `max_tokens` and the cut list was lost; bounded to
    one call per tool, the reply is whole calls."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Country(BaseModel):
        country: str

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=smol.url + "/v1", api_key="x"))
    settings: Any = {"max_tokens": 200, "temperature": 0}
    agent = Agent(model, output_type=[City, Country], model_settings=settings)
    result = agent.run_sync("Name a city in France.")
    assert isinstance(result.output, City | Country)
    responses = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    calls = [p for m in responses for p in m.parts if isinstance(p, ToolCallPart)]
    assert 1 <= len(calls) <= 2 * len(responses)
    assert {c.tool_name for c in calls} <= {"final_result_City", "final_result_Country"}


def test_langchain_structured_output_and_tools(smol: LiveServer) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=smol.url + "/v1", api_key="x", temperature=0, max_tokens=80
    )  # type: ignore[call-arg]
    for method in ("json_schema", "function_calling", "json_mode"):
        structured = llm.with_structured_output(City, method=method)  # type: ignore[arg-type]
        prompt = "Give a city and its country as JSON with keys name and country."
        out: Any = structured.invoke(prompt)
        assert isinstance(out, City), method
    question = [HumanMessage("What is the weather in Paris?")]
    for choice in ("any", "get_weather"):
        bound = llm.bind_tools([WEATHER], tool_choice=choice)
        reply = bound.invoke(question)
        assert reply.tool_calls and reply.tool_calls[0]["name"] == "get_weather"
    chunks = list(llm.bind_tools([WEATHER], tool_choice="any").stream(question))
    merged: Any = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk
    assert merged.tool_calls and merged.tool_calls[0]["name"] == "get_weather"
    # a full round trip: the call, its result, the model's answer
    reply = llm.bind_tools([WEATHER], tool_choice="any").invoke(question)
    call = reply.tool_calls[0]
    answer = llm.invoke([*question, reply, ToolMessage("sunny", tool_call_id=call["id"])])
    assert isinstance(answer.content, str)
