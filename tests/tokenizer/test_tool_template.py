"""tool_use.jinja, rendered the way the tokenizer renders chat (transformers' jinja): the same
as SmolLM2's own template without tools; Hermes-style tool turns with them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.model_files import embedded_gguf_path
from services.frontend.openai.tool_parsers import get_tool_parser

pytestmark = pytest.mark.slow

TEMPLATE = (Path(__file__).resolve().parents[2]
            / "services/tokenizer/templates/tool_use.jinja").read_text()
SMOLLM_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "e.g. Paris, 東京"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time now.",
    "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerBase:
    gguf = embedded_gguf_path()             # as tests/reference.py loads it
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           chat_template: str | None = TEMPLATE) -> str:
    text = tokenizer.apply_chat_template(messages, tools=tools, chat_template=chat_template,
                                         add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    assert isinstance(text, str)
    return text


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "Et en français ?\nRéponds en une ligne. 😀"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": ""}, {"role": "system", "content": "Now be brief."},
     {"role": "user", "content": "  spaced  "}],
    [{"role": "assistant", "content": "I start."}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_it_renders_as_smollm2(tokenizer: PreTrainedTokenizerBase,
                                             messages: list[dict[str, Any]],
                                             add_generation_prompt: bool) -> None:
    own = render(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                 chat_template=None)
    assert own.startswith("<|im_start|>system\n")       # SmolLM2's template, not a fallback
    assert render(tokenizer, messages, add_generation_prompt=add_generation_prompt) == own


def tools_system_turn(system: str, tools: list[dict[str, Any]]) -> str:
    listed = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        f"<|im_start|>system\n{system}\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


def test_tools_are_listed_in_the_system_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "You are a weather bot."},
                {"role": "user", "content": "Weather in Paris?"}]
    assert render(tokenizer, messages, tools=[WEATHER_TOOL, TIME_TOOL]) == (
        tools_system_turn("You are a weather bot.", [WEATHER_TOOL, TIME_TOOL])
        + "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tools_without_a_system_message_use_the_default_system(
        tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "user", "content": "Time?"}]
    assert render(tokenizer, messages, tools=[TIME_TOOL], add_generation_prompt=False) == (
        tools_system_turn(SMOLLM_SYSTEM, [TIME_TOOL])
        + "<|im_start|>user\nTime?<|im_end|>\n")


def test_tool_calls_and_their_results(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "東京"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 18}'},
        {"role": "tool", "tool_call_id": "call_2",
         "content": [{"type": "text", "text": '{"temp": '}, {"type": "text", "text": "25}"}]},
        {"role": "assistant", "content": "Paris 18°C, Tokyo 25°C.", "tool_calls": [
            {"id": "call_3", "type": "function", "function": {
                "name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "12:00"},
    ]
    assert render(tokenizer, messages, tools=[WEATHER_TOOL, TIME_TOOL]) == (
        tools_system_turn(SMOLLM_SYSTEM, [WEATHER_TOOL, TIME_TOOL])
        + "<|im_start|>user\nWeather in Paris and Tokyo?<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n{\"temp\": 18}\n</tool_response>\n"
        "<tool_response>\n{\"temp\": 25}\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nParis 18°C, Tokyo 25°C.\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_hermes_parser_reads_back_rendered_calls(tokenizer: PreTrainedTokenizerBase) -> None:
    """What the template shows the model as a call is what the hermes parser takes for one."""
    calls = [{"type": "function", "function": {"name": "get_weather",
                                               "arguments": '{"city": "Zürich"}'}}]
    rendered = render(tokenizer, [{"role": "user", "content": "?"},
                                  {"role": "assistant", "content": "Checking.",
                                   "tool_calls": calls}], add_generation_prompt=False)
    turn = rendered.split("<|im_start|>assistant\n")[1].removesuffix("<|im_end|>\n")
    output = get_tool_parser("hermes").parse(turn)
    assert output.content == "Checking."
    assert [(c.name, c.arguments) for c in output.tool_calls] == [
        ("get_weather", '{"city": "Zürich"}')]


def test_content_parts_keep_their_text(tokenizer: PreTrainedTokenizerBase) -> None:
    parts = [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {
        "url": "data:image/png;base64,AAAA"}}, {"type": "text", "text": "this."}]
    system = [{"type": "text", "text": "Be brief."}]
    messages = [{"role": "system", "content": system}, {"role": "user", "content": parts}]
    flat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Describe this."}]
    assert render(tokenizer, messages) == render(tokenizer, flat, chat_template=None)
    assert render(tokenizer, messages, tools=[TIME_TOOL]).startswith(
        tools_system_turn("Be brief.", [TIME_TOOL]))
