"""A model family's tool-call format, as one grammar that serves a whole text and a stream.

Two shapes of format: calls after a marker anywhere in the reply, with content around them
(hermes, mistral), and calls that open the reply (llama3_json, pythonic). A family says its
marker or openings and the grammar of the calls that follow.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from services.frontend.openai.tool_parsers.text_cursor import Pending, TextCursor
from services.frontend.openai.tool_parsers.tool_call import (
    ParsedOutput,
    StreamEvent,
    collect_events,
)


class ToolParser(ABC):
    name: ClassVar[str]                     # as vLLM's --tool-call-parser names it

    @abstractmethod
    def grammar(self, cursor: TextCursor) -> Pending[None]:
        """Reads the whole reply: content and tool calls."""

    @abstractmethod
    def calls(self, cursor: TextCursor) -> Pending[None]:
        """Reads one region of tool calls, raising Malformed where the text is not one."""

    def parse(self, text: str) -> ParsedOutput:
        return collect_events(self.stream().finish(text))

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.grammar)


class MarkerToolParser(ToolParser):
    """Calls after `marker`, anywhere in the reply and as often as the model likes."""
    marker: ClassVar[str]

    def grammar(self, cursor: TextCursor) -> Pending[None]:
        while (start := (yield from cursor.content_until((self.marker,)))) is not None:
            yield from cursor.region(self.calls(cursor), start)


class LeadingToolParser(ToolParser):
    """Calls that open the reply (after whitespace), then content if any follows."""
    openings: ClassVar[tuple[str, ...]]

    def grammar(self, cursor: TextCursor) -> Pending[None]:
        start = cursor.pos
        if (yield from cursor.peek(self.openings)) is not None:
            yield from cursor.region(self.calls(cursor), start)
        yield from cursor.content_until(())


class ToolCallStream:
    """Text deltas in, OpenAI content and tool-call deltas out."""

    def __init__(self, grammar: Callable[[TextCursor], Pending[None]]) -> None:
        self._cursor = TextCursor()
        self._grammar = grammar(self._cursor)
        self._is_done = False

    def feed(self, delta: str) -> list[StreamEvent]:
        assert not self._is_done, "fed after finish"
        self._cursor.text += delta
        try:
            next(self._grammar)
        except StopIteration:
            self._is_done = True
        assert self._is_done or not self._cursor.is_final, "a grammar reads to the end"
        return self._cursor.take_events()

    def finish(self, delta: str = "") -> list[StreamEvent]:
        """The last delta (if any): what was held back goes out."""
        self._cursor.is_final = True
        return self.feed(delta)
