"""Agent libraries drive the real mesh and each returns a valid object: LangChain's structured
output (json_schema) and forced tool calls, and instructor's JSON_SCHEMA and TOOLS modes.

instructor runs from its own venv (.venv-agents, made by scripts/bootstrap.sh): its newest
release (1.17.0) pins jiter < 0.15 while the openai client we test with (3.57) needs
jiter >= 0.16, so the two cannot share one."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.e2e.agent_models import Fruit
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
AGENTS_PYTHON = REPO_ROOT / ".venv-agents" / "bin" / "python"



@tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city, for a number of days."""
    return f"sunny in {city} for {days} days"


@pytest.fixture(scope="module")
def chat_model(mesh: Mesh, model_name: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{mesh.base_url}/v1", api_key="unused", model=model_name,
                      temperature=0, max_tokens=96, max_retries=0, timeout=120)


def test_with_structured_output_json_schema(chat_model: ChatOpenAI) -> None:
    fruit = chat_model.with_structured_output(Fruit, method="json_schema").invoke(
        "Describe an apple.")
    assert isinstance(fruit, Fruit)


def test_bind_tools_with_a_named_tool_choice(chat_model: ChatOpenAI) -> None:
    message = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke(
        "What will the weather be in Paris for the next 3 days?")
    assert [call["name"] for call in message.tool_calls] == ["get_weather"]
    schema = get_weather.tool_call_schema.model_json_schema()
    jsonschema.validate(message.tool_calls[0]["args"], schema)


@pytest.mark.parametrize("mode", ["json_schema", "tools"])
def test_instructor_returns_a_valid_object(mesh: Mesh, model_name: str, mode: str) -> None:
    assert AGENTS_PYTHON.exists(), "scripts/bootstrap.sh makes .venv-agents (make test runs it)"
    run = subprocess.run(
        [str(AGENTS_PYTHON), "-m", "tests.e2e.instructor_client",
         "--base-url", f"{mesh.base_url}/v1", "--model", model_name, "--mode", mode],
        capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    Fruit.model_validate(json.loads(run.stdout))

