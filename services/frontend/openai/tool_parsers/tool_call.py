"""What the tool parsers produce: whole calls for a response, OpenAI deltas for a stream."""

from __future__ import annotations

import random
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def make_tool_call_id() -> str:
    """`call_` and 24 letters or digits, the shape OpenAI (and vLLM) give call ids."""
    return "call_" + "".join(random.choices(_ID_ALPHABET, k=24))


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                          # a JSON object, as text
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None                     # None when the text was only tool calls
    tool_calls: list[ToolCall]


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of call `index`: its first delta has the id and name, the rest only arguments."""
    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


StreamEvent = ContentDelta | ToolCallDelta


def merge_events(first: StreamEvent, second: StreamEvent) -> StreamEvent | None:
    """One delta saying both, where there is one (adjacent content, or a call's next piece)."""
    if isinstance(first, ContentDelta) and isinstance(second, ContentDelta):
        return ContentDelta(first.text + second.text)
    if (isinstance(first, ToolCallDelta) and isinstance(second, ToolCallDelta)
            and second.index == first.index and second.id is None):
        return replace(first, arguments=first.arguments + second.arguments)
    return None


def collect_events(events: Iterable[StreamEvent]) -> ParsedOutput:
    """The whole response a stream of deltas adds up to."""
    content: list[str] = []
    heads: dict[int, tuple[str, str]] = {}  # index -> (name, id)
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
            continue
        if event.id is not None:
            assert event.name is not None, "a call's first delta names it"
            heads[event.index] = (event.name, event.id)
        arguments.setdefault(event.index, []).append(event.arguments)
    calls = [ToolCall(name, "".join(arguments[index]), call_id)
             for index, (name, call_id) in sorted(heads.items())]
    return ParsedOutput("".join(content) or None, calls)


def keep_first_call(output: ParsedOutput) -> ParsedOutput:
    """`parallel_tool_calls: false`: the first call only."""
    return replace(output, tool_calls=output.tool_calls[:1])


def drop_later_calls(events: Sequence[StreamEvent]) -> list[StreamEvent]:
    """`parallel_tool_calls: false` on a stream: the deltas of the first call only."""
    return [e for e in events if not (isinstance(e, ToolCallDelta) and e.index > 0)]
