"""Tool calling on the real mesh, through the official openai client: forced calls (required,
named) validate against their tool's schema, streamed calls add up to the non-streamed ones,
auto mode parses what the model writes, a multi-turn exchange with tool results renders, and
misuse answers 400."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from tests.mesh import Mesh, http_post

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description":
                                      "The current weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description":
                                      "The time in a timezone", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]


def ask(client: openai.OpenAI, model: str, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=model, tools=TOOLS, temperature=0, **kwargs)


def assert_valid_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_gives_a_call_that_matches_its_schema(client: openai.OpenAI,
                                                                model_name: str) -> None:
    out = ask(client, model_name,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    assert_valid_calls(choice.message.tool_calls)


def test_required_tool_choice_gives_valid_calls(client: openai.OpenAI, model_name: str) -> None:
    out = ask(client, model_name, tool_choice="required", max_tokens=120)
    assert out.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(out.choices[0].message.tool_calls)
    single = ask(client, model_name, tool_choice="required", parallel_tool_calls=False,
                 max_tokens=120)
    assert len(single.choices[0].message.tool_calls) == 1


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_calls_add_up_to_the_non_streamed(client: openai.OpenAI, model_name: str,
                                                   tool_choice: Any) -> None:
    whole = ask(client, model_name, tool_choice=tool_choice, max_tokens=120)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in ask(client, model_name, tool_choice=tool_choice, max_tokens=120, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for piece in choice.delta.tool_calls or []:
                call = calls.setdefault(piece.index, {"name": "", "arguments": ""})
                if piece.function.name:
                    assert not call["name"], "a call's name comes once"
                    call["name"] = piece.function.name
                call["arguments"] += piece.function.arguments or ""
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == "tool_calls"


def test_auto_parses_the_calls_the_model_writes(client: openai.OpenAI, model_name: str) -> None:
    """The embedded model follows the shipped hermes template when nudged: its <tool_call>
    block comes back as a call, never as content; the stream gives the same calls."""
    messages = [{"role": "system", "content": "You call tools. Answer only with a tool call."},
                *QUESTION]
    out = ask(client, model_name, messages=messages, tool_choice="auto")
    message = out.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    streamed_text, streamed_calls = "", {}
    for chunk in ask(client, model_name, messages=messages, tool_choice="auto", stream=True):
        for choice in chunk.choices:
            streamed_text += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                call = streamed_calls.setdefault(piece.index, ["", ""])
                call[0] += piece.function.name or ""
                call[1] += piece.function.arguments or ""
    assert streamed_text == (message.content or "")
    assert [tuple(streamed_calls[i]) for i in sorted(streamed_calls)] == \
        [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    if message.tool_calls:
        assert out.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_gives_plain_text(client: openai.OpenAI, model_name: str) -> None:
    out = ask(client, model_name, tool_choice="none")
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason in ("stop", "length")


def test_a_multi_turn_exchange_with_tool_results(mesh: Mesh, client: openai.OpenAI,
                                                 model_name: str) -> None:
    first = ask(client, model_name,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id,
                 "content": [{"type": "text", "text": '{"temperature": 21}'}]}]
    _, tokenized = http_post(f"{mesh.base_url}/tokenize", {
        "model": model_name, "messages": messages, "tools": TOOLS})
    _, detokenized = http_post(f"{mesh.base_url}/detokenize", {
        "model": model_name, "tokens": tokenized["tokens"]})
    rendered = detokenized["prompt"]
    assert "<tools>" in rendered and '"get_weather"' in rendered
    assert "<tool_call>" in rendered and call.function.arguments in rendered
    assert "<tool_response>\n{\"temperature\": 21}\n</tool_response>" in rendered
    answer = ask(client, model_name, messages=messages, tool_choice="none")
    assert answer.choices[0].message.content


@pytest.mark.parametrize("kwargs,param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required",
      "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_tool_misuse_answers_400(client: openai.OpenAI, model_name: str,
                                 kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, model_name, **kwargs)
    assert param in str(raised.value)
