"""What tool_choice asks of the engine, and how a choice's text becomes content, tool calls and
reasoning, whole and streamed (the two must agree)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from services.frontend.errors import ApiError
from services.frontend.openai.chat_tools import ChatOutput, plan_tools
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.settings import FrontendSettings

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time"}}]


def body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
         **fields})


def streamed(output: ChatOutput, pieces: list[str]) -> tuple[str, str, dict[int, list[str]]]:
    content, reasoning, calls = "", "", {}
    for i, piece in enumerate(pieces):
        delta = output.delta(piece, is_last=i == len(pieces) - 1)
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call["function"].get("name") or ""
            entry[1] += call["function"]["arguments"]
    return content, reasoning, calls


def test_named_choice_constrains_to_the_function_arguments() -> None:
    plan = plan_tools(body(tool_choice={"type": "function",
                                        "function": {"name": "get_weather"}}),
                      FrontendSettings())
    assert plan is not None and plan.is_forced
    assert json.loads(plan.grammar().spec.spec) == WEATHER
    output = ChatOutput(plan, FrontendSettings())
    message = output.message('{"city": "Paris"}')
    assert message["content"] is None and output.called_tools
    assert message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                    "arguments": '{"city": "Paris"}'}
    _, _, calls = streamed(ChatOutput(plan, FrontendSettings()), ['{"ci', 'ty": "Paris"}'])
    assert calls == {0: ["get_weather", '{"city": "Paris"}']}


def test_required_choice_is_a_list_of_calls_one_when_not_parallel() -> None:
    plan = plan_tools(body(tool_choice="required", parallel_tool_calls=False),
                      FrontendSettings())
    assert plan is not None
    schema = json.loads(plan.grammar().spec.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    text = '[{"name": "get_weather", "arguments": {"city": "Lima"}}]'
    message = ChatOutput(plan, FrontendSettings()).message(text)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"]
    assert streamed(ChatOutput(plan, FrontendSettings()), [text[:10], text[10:]])[2] == \
        {0: ["get_weather", '{"city": "Lima"}']}


AUTO_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("parallel,num_calls", [(True, 2), (False, 1)])
def test_auto_parses_hermes_calls_whole_and_streamed_alike(parallel: bool,
                                                          num_calls: int) -> None:
    plan = plan_tools(body(parallel_tool_calls=parallel), FrontendSettings())
    assert plan is not None and plan.mode == "auto" and not plan.is_forced
    message = ChatOutput(plan, FrontendSettings()).message(AUTO_TEXT)
    assert message["content"] == "Let me check."
    assert len(message["tool_calls"]) == num_calls
    content, _, calls = streamed(ChatOutput(plan, FrontendSettings()), list(AUTO_TEXT))
    assert content == message["content"]
    assert [tuple(calls[i]) for i in sorted(calls)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_reasoning_is_split_before_tool_calls_are_parsed() -> None:
    settings = FrontendSettings(reasoning_parser="qwen3")
    plan = plan_tools(body(), settings)
    text = "<think>The user wants weather.</think>\n\n" + AUTO_TEXT
    message = ChatOutput(plan, settings).message(text)
    assert message["reasoning_content"] == "The user wants weather."
    assert message["content"] == "Let me check." and len(message["tool_calls"]) == 2
    content, reasoning, calls = streamed(ChatOutput(plan, settings), list(text))
    assert (content, reasoning, len(calls)) == ("Let me check.", "The user wants weather.", 2)


@pytest.mark.parametrize("choice", [{"type": "function", "function": {"name": "get_weather"}},
                                    "required"], ids=["named", "required"])
def test_a_forced_call_is_the_answer_after_the_reasoning(choice: object) -> None:
    """The grammar applies after </think> (the worker's side), so the call is parsed from
    the answer alone; streamed, the call opens with its first arguments, not while the
    model reasons."""
    settings = FrontendSettings(reasoning_parser="deepseek_r1")
    plan = plan_tools(body(tool_choice=choice), settings)
    assert plan is not None
    answer = ('{"city": "Paris"}' if plan.function is not None
              else '[{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    text = "Weather means get_weather.</think>\n\n" + answer
    message = ChatOutput(plan, settings).message(text)
    assert message["reasoning_content"] == "Weather means get_weather."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    if plan.function is not None:
        output = ChatOutput(plan, settings)
        first_call = next(delta["tool_calls"][0] for piece in text
                          if "tool_calls" in (delta := output.delta(piece, is_last=False)))
        assert first_call["function"] == {"name": "get_weather", "arguments": "{"}
    content, reasoning, calls = streamed(ChatOutput(plan, settings), list(text))
    assert (content, reasoning) == ("", "Weather means get_weather.")
    assert [(name, json.loads(arguments)) for name, arguments in calls.values()] == [
        ("get_weather", {"city": "Paris"})]


def test_tool_choice_none_leaves_text_alone() -> None:
    plan = plan_tools(body(tool_choice="none"), FrontendSettings())
    assert ChatOutput(plan, FrontendSettings()).message(AUTO_TEXT)["content"] == AUTO_TEXT


@pytest.mark.parametrize("fields,settings", [
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, {}),
    ({"tool_choice": "auto"}, {"enable_auto_tool_choice": False}),
    ({"tools": None, "tool_choice": "required"}, {}),
    ({"tools": TOOLS + TOOLS[:1]}, {}),
])
def test_misuse_is_a_400_naming_the_field(fields: dict[str, Any],
                                          settings: dict[str, Any]) -> None:
    with pytest.raises(ApiError) as raised:
        plan_tools(body(**fields), FrontendSettings(**settings))
    assert raised.value.status == 400 and raised.value.param in ("tool_choice", "tools")
