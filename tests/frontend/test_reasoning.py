"""Reasoning sections split from the answer, whole and streamed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.common.frontend.reasoning import ReasoningDelta, get_reasoning_parser

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
