"""Reasoning sections (`<think>...</think>`) split from the answer, as vLLM's
`--reasoning-parser` does: the reasoning goes to `reasoning_content` (and vLLM's newer
`reasoning`), the rest to `content`, whole or as stream deltas.

Two families, by vLLM's names:
- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output is reasoning
  from its first token until `</think>` (an explicit `<think>` at the start is dropped).
- `qwen3`: reasoning only when the output opens with `<think>` (thinking can be switched
  off in the template, and then the output is all answer).
An output that never closes its reasoning is all reasoning, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.common import wire

START, END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str | None
    content: str | None


class ReasoningParser:
    name: ClassVar[str]
    opens_in_prompt: ClassVar[bool]   # reasoning starts without a <think> in the output

    def parse(self, text: str) -> ReasoningSplit:
        stream = self.stream()
        first = stream.feed(text)
        last = stream.finish()
        reasoning = first.reasoning + last.reasoning
        content = first.content + last.content
        return ReasoningSplit(reasoning or None, content or None)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.opens_in_prompt)

    def markers(self) -> wire.ReasoningMarkers:
        """The section's markers, for a grammar that applies after it (the tokenizer adds
        their token ids)."""
        return wire.ReasoningMarkers(start=START, end=END, opens_in_prompt=self.opens_in_prompt)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_in_prompt = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_in_prompt = False


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """Text deltas in, (reasoning, content) deltas out. Text that may be the start of a
    marker is held back until the next delta shows what it is."""

    def __init__(self, opens_in_prompt: bool) -> None:
        # States: "start" (may see <think>), "reasoning", "answer" (newlines after
        # </think> are dropped until the answer begins), "content".
        self._state = "start"
        self._opens_in_prompt = opens_in_prompt
        self._held = ""

    def feed(self, delta: str) -> ReasoningDelta:
        self._held += delta
        out = ReasoningDelta()
        while self._held:
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(START):
                    self._held = stripped[len(START):]
                    self._state = "reasoning"
                elif START.startswith(stripped):
                    break       # maybe the start of <think>: wait for more
                else:
                    self._state = "reasoning" if self._opens_in_prompt else "content"
            elif self._state == "reasoning":
                index = self._held.find(END)
                if index != -1:
                    out.reasoning += self._held[:index]
                    self._held = self._held[index + len(END):]
                    self._state = "answer"
                    continue
                keep = _partial_marker_length(self._held, END)
                out.reasoning += self._held[:len(self._held) - keep]
                self._held = self._held[len(self._held) - keep:]
                break
            elif self._state == "answer":
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = "content"
            else:
                out.content += self._held
                self._held = ""
        return out

    def finish(self) -> ReasoningDelta:
        """What was held back, once the output ended."""
        held, self._held = self._held, ""
        if self._state in ("answer", "content") or (self._state == "start"
                                                    and not self._opens_in_prompt):
            return ReasoningDelta(content=held)
        return ReasoningDelta(reasoning=held)


def _partial_marker_length(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return _PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of "
                         f"{', '.join(sorted(_PARSERS))}") from None
