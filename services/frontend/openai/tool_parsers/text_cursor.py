"""A cursor over a model's text that is still arriving: the reads a tool-call grammar needs,
and the deltas it emits.

A grammar is a generator. A read that cannot decide yet (a marker cut in half, a JSON value
still open, whitespace that may go on) yields, and the stream resumes it when more text
arrives or the text ends. So a grammar reads like a plain recursive-descent parser, and one
grammar serves a whole text and a stream alike: it decides only on text it has seen, so its
deltas add up to the same, wherever the text was split.

The one exception is a call found malformed (invalid JSON, text ending mid-call): a region of
tool calls turns back into content, but a stream can only take back what it has not yet
handed out. A call goes out no sooner than its arguments begin, which keeps that rare.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import TypeVar

from services.frontend.openai.tool_parsers.tool_call import (
    ContentDelta,
    StreamEvent,
    ToolCallDelta,
    make_tool_call_id,
    merge_events,
)
from services.frontend.openai.tool_parsers.value_scanner import ValueScanner

T = TypeVar("T")
Pending = Generator[None, None, T]          # a read: yields while it needs more text

_WHITESPACE = re.compile(r"\s*")
_WORD = re.compile(r"[\w.\-]+")             # a function or argument name


class Malformed(Exception):
    """The text is not the tool call it began like."""


class TextCursor:
    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.is_final = False               # no more text will come
        self._events: list[StreamEvent] = []
        self._num_taken = 0                 # events handed out: those cannot be taken back
        self._num_calls = 0

    # -- content -------------------------------------------------------------------------

    def content_until(self, markers: tuple[str, ...]) -> Pending[int | None]:
        """Emits content up to the first of `markers` and reads past it. Returns where the
        call region starts (the whitespace before the marker is the region's, not content),
        or None when the text ended first. Text that may begin a marker is held back."""
        while True:
            found = self._find_first(markers)
            if found is not None:
                index, marker = found
                start = self._strip_whitespace_before(index)
                self.emit_content(self.text[self.pos:start])
                self.pos = index + len(marker)
                return start
            if self.is_final:
                self.emit_content(self.text[self.pos:])
                self.pos = len(self.text)
                return None
            safe = len(self.text) - _partial_marker_length(self.text, self.pos, markers)
            if markers:
                safe = self._strip_whitespace_before(safe)
            self.emit_content(self.text[self.pos:safe])
            # NOTE: no read holds a position here, so the emitted text can go (no O(n^2) copies).
            self.text, self.pos = self.text[safe:], 0
            yield

    def region(self, calls: Pending[None], start: int) -> Pending[bool]:
        """Runs `calls`, the grammar of a region of tool calls that began at `start` and whose
        marker was read up to here; the whitespace after the region is the region's too.
        Malformed text turns back into content: the whole region while none of it has gone
        out (reading resumes after the marker), else what follows what went out."""
        resume = self.pos
        num_events, num_calls = self._num_taken + len(self._events), self._num_calls
        try:
            yield from calls
        except Malformed:
            if self._num_taken <= num_events:
                del self._events[num_events - self._num_taken:]
                self._num_calls = num_calls
                self.emit_content(self.text[start:resume])
                self.pos = resume
            return False
        yield from self.skip_whitespace()
        return True

    # -- reads inside a region -------------------------------------------------------------

    def skip_whitespace(self) -> Pending[None]:
        """Reads past whitespace; waits for what follows, so a split cannot cut the run."""
        while True:
            self.pos = self._after_whitespace()
            if self.pos < len(self.text) or self.is_final:
                return
            yield

    def peek(self, options: tuple[str, ...]) -> Pending[str | None]:
        """The option the text goes on with after any whitespace, or None; reads nothing."""
        while True:
            start = self._after_whitespace()
            rest = self.text[start:start + max(map(len, options))]
            matched = next((option for option in options if rest.startswith(option)), None)
            if matched is not None:
                return matched
            if self.is_final or not any(option.startswith(rest) for option in options):
                return None
            yield

    def accept(self, option: str) -> Pending[bool]:
        """Reads past whitespace and `option` if the text goes on with it."""
        if (yield from self.peek((option,))) is None:
            return False
        self.pos = self._after_whitespace() + len(option)
        return True

    def expect(self, option: str) -> Pending[None]:
        if not (yield from self.accept(option)):
            raise Malformed(f"expected {option!r}")

    def at_end(self) -> Pending[bool]:
        """Whether only whitespace is left (read past it)."""
        yield from self.skip_whitespace()
        return self.pos == len(self.text)

    def word(self) -> Pending[str]:
        """A name (letters, digits, `_`, `.`, `-`) after whitespace."""
        yield from self.skip_whitespace()
        while (match := _WORD.match(self.text, self.pos)) is not None:
            if match.end() < len(self.text) or self.is_final:
                self.pos = match.end()
                return match.group()
            yield
        raise Malformed("expected a name")

    def value(self, is_python: bool = False, stream_to: int | None = None) -> Pending[str]:
        """The text of one JSON value (or Python literal) after whitespace. With `stream_to`,
        a call's index, the text goes out as that call's arguments as it arrives."""
        yield from self.skip_whitespace()
        start = self.pos
        scanner = ValueScanner(start, is_python)
        while (end := scanner.advance(self.text, self.is_final)) is None:
            if self.is_final:
                raise Malformed("the text ended inside a value")
            if stream_to is not None:
                self.emit_arguments(stream_to, self.text[self.pos:scanner.pos])
                self.pos = scanner.pos
            yield
        if stream_to is not None:
            self.emit_arguments(stream_to, self.text[self.pos:end])
        self.pos = end
        return self.text[start:end]

    # -- deltas ----------------------------------------------------------------------------

    def emit_content(self, text: str) -> None:
        if text:
            self._emit(ContentDelta(text))

    def open_call(self, name: str) -> int:
        """Starts the next call; its first delta carries the id and name."""
        index = self._num_calls
        self._num_calls += 1
        self._emit(ToolCallDelta(index, "", id=make_tool_call_id(), name=name))
        return index

    def emit_arguments(self, index: int, text: str) -> None:
        if text:
            self._emit(ToolCallDelta(index, text))

    def take_events(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        self._num_taken += len(events)
        return events

    def _emit(self, event: StreamEvent) -> None:
        merged = merge_events(self._events[-1], event) if self._events else None
        if merged is None:
            self._events.append(event)
        else:
            self._events[-1] = merged

    def _find_first(self, markers: tuple[str, ...]) -> tuple[int, str] | None:
        found = [(index, marker) for marker in markers
                 if (index := self.text.find(marker, self.pos)) != -1]
        return min(found, default=None)

    def _after_whitespace(self) -> int:
        match = _WHITESPACE.match(self.text, self.pos)
        return match.end() if match else self.pos

    def _strip_whitespace_before(self, end: int) -> int:
        while end > self.pos and self.text[end - 1].isspace():
            end -= 1
        return end


def _partial_marker_length(text: str, start: int, markers: tuple[str, ...]) -> int:
    """How many characters at the end of text[start:] may be the beginning of a marker."""
    longest = min(max(map(len, markers), default=1) - 1, len(text) - start)
    for length in range(longest, 0, -1):
        if any(marker.startswith(text[-length:]) for marker in markers):
            return length
    return 0
