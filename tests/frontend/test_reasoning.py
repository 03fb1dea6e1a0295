"""Reasoning sections split from the answer, whole and streamed; a constrained chat request
names the section's markers, so its grammar applies after it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from services.common.metrics import GatewayMetrics
from services.common.model_files import resolve_model
from services.common.packing import unpack_int32
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_view import MeshView
from services.frontend.engine_client.request_run import RequestPlan
from services.frontend.openai.protocol import ChatCompletionRequest
from services.frontend.openai.reasoning import ReasoningDelta, get_reasoning_parser
from services.frontend.openai.serving_chat import ChatCompletion
from services.frontend.settings import FrontendSettings
from services.tokenizer.service import engine_grammar
from services.tokenizer.text_codec import TextCodec

CASES = [
    # (parser, model output, reasoning, content)
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello!", "\nThe user greets me.\n",
     "Hello!"),
    ("qwen3", "Hello without thinking.", None, "Hello without thinking."),
    ("qwen3", "<think>\n\n</think>\n\nShort answer.", "\n\n", "Short answer."),
    ("qwen3", "<think>never closed", "never closed", None),
    ("qwen3", "a < b, and </think> is just text", None, "a < b, and </think> is just text"),
    ("deepseek_r1", "Let me think: 2+2=4.</think>The answer is 4.", "Let me think: 2+2=4.",
     "The answer is 4."),
    ("deepseek_r1", "<think>x</think>y", "x", "y"),
    ("deepseek_r1", "still thinking", "still thinking", None),
    ("deepseek_r1", "思考：<b></think>答案 ✓", "思考：<b>", "答案 ✓"),
]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_parse_splits_reasoning_from_content(name: str, text: str, reasoning: str | None,
                                             content: str | None) -> None:
    split = get_reasoning_parser(name).parse(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def _streamed(name: str, pieces: list[str]) -> tuple[str, str]:
    stream = get_reasoning_parser(name).stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_one_character_at_a_time_streams_the_same(name: str, text: str,
                                                  reasoning: str | None,
                                                  content: str | None) -> None:
    assert _streamed(name, list(text)) == (reasoning or "", content or "")


@given(st.sampled_from(CASES), st.lists(st.integers(0, 60), max_size=8))
def test_any_split_streams_the_same(case: tuple, cuts: list[int]) -> None:
    name, text, reasoning, content = case
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _streamed(name, pieces) == (reasoning or "", content or "")


def test_a_partial_end_marker_is_held_back_until_it_resolves() -> None:
    stream = get_reasoning_parser("deepseek_r1").stream()
    assert stream.feed("abc</thi") == ReasoningDelta(reasoning="abc")
    assert stream.feed("nk>def") == ReasoningDelta(content="def")


def test_an_unknown_parser_is_named() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("nope")


# ---- a constraint applies after the reasoning section -----------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CONSTRAINED = {
    "response_format": {"response_format": {"type": "json_schema",
                                            "json_schema": {"name": "w", "schema": WEATHER}}},
    "named tool": {"tools": TOOLS, "tool_choice": {"type": "function",
                                                   "function": {"name": "get_weather"}}},
    "required tool": {"tools": TOOLS, "tool_choice": "required"},
}


def chat_plan(reasoning_parser: str, **fields: Any) -> RequestPlan:
    ctx = FrontendContext(FrontendSettings(reasoning_parser=reasoning_parser),
                          SimpleNamespace(gateway_id="g"),  # type: ignore[arg-type]
                          MeshView(60.0), GatewayMetrics(CollectorRegistry()))
    body = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})
    return ChatCompletion(body, ctx).plan()


@pytest.mark.parametrize("fields", list(CONSTRAINED.values()), ids=list(CONSTRAINED))
@pytest.mark.parametrize(("parser", "opens_in_prompt"), [("deepseek_r1", True),
                                                         ("qwen3", False)])
def test_a_constrained_chat_carries_the_reasoning_markers(fields: dict[str, Any], parser: str,
                                                          opens_in_prompt: bool) -> None:
    plan = chat_plan(parser, **fields)
    assert plan.grammar is not None
    markers = plan.grammar.spec.reasoning
    assert (markers.start, markers.end, markers.opens_in_prompt) == (
        "<think>", "</think>", opens_in_prompt)
    unmarked = chat_plan("", **fields).grammar
    assert unmarked is not None and not unmarked.spec.reasoning.end   # from the first token


def test_the_tokenizer_gives_the_markers_as_its_token_ids() -> None:
    codec = TextCodec(resolve_model("").hf_dir)
    grammar = chat_plan("qwen3", **CONSTRAINED["response_format"]).grammar
    assert grammar is not None
    markers = engine_grammar(grammar.spec, codec).reasoning
    assert unpack_int32(markers.start_token_ids).tolist() == codec.encode("<think>", False)
    assert unpack_int32(markers.end_token_ids).tolist() == codec.encode("</think>", False)
    assert len(markers.end_token_ids) == 3 * 4   # "</" "think" ">" in this vocabulary
