"""The OpenAI Agents SDK drives the real mesh through the Responses API (its default): an
agent calls its tool, an agent answers in text, and an agent returns a typed object."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunResult,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from pydantic import BaseModel, ConfigDict

from tests.mesh import Mesh

pytestmark = pytest.mark.slow

cities_asked: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    cities_asked.append(city)
    return f"sunny in {city}"


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str
    degrees: int


@pytest.fixture(scope="module", autouse=True)
def no_tracing() -> Iterator[None]:
    set_tracing_disabled(True)   # the SDK would export traces to OpenAI's servers
    yield
    set_tracing_disabled(False)


def run_agent(mesh: Mesh, model_name: str, prompt: str, **agent_options: Any) -> RunResult:
    async def go() -> RunResult:
        client = openai.AsyncOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=120)
        try:
            agent = Agent(name="assistant",
                          model=OpenAIResponsesModel(model=model_name, openai_client=client),
                          **agent_options)
            return await Runner.run(agent, prompt, max_turns=3)
        finally:
            await client.close()

    return asyncio.run(go())


def test_an_agent_calls_its_tool(mesh: Mesh, model_name: str) -> None:
    cities_asked.clear()
    result = run_agent(
        mesh, model_name, "What is the weather in Paris?", instructions="Use the tools.",
        tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=60))
    assert len(cities_asked) == 1 and cities_asked[0]
    assert result.final_output == f"sunny in {cities_asked[0]}"
    [model_response] = result.raw_responses
    assert model_response.response_id is not None
    assert model_response.response_id.startswith("resp")


def test_an_agent_answers_in_text(mesh: Mesh, model_name: str, client: openai.OpenAI) -> None:
    # NOTE: the SDK fails an incomplete response, so the answer must end before the cap.
    result = run_agent(mesh, model_name, "Say hello.", instructions="Answer in one word.",
                       model_settings=ModelSettings(temperature=0, max_tokens=200))
    direct = client.responses.create(model=model_name, instructions="Answer in one word.",
                                     input="Say hello.", temperature=0, max_output_tokens=200)
    assert result.final_output == direct.output_text and direct.output_text


def test_an_agent_returns_a_typed_object(mesh: Mesh, model_name: str) -> None:
    result = run_agent(mesh, model_name, "The weather in Lima, as JSON.",
                       output_type=Weather,
                       model_settings=ModelSettings(temperature=0, max_tokens=60))
    assert isinstance(result.final_output, Weather)
