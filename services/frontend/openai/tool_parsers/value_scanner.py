"""Finds where one JSON value or Python literal ends, in text that is still arriving."""

from __future__ import annotations

_OPENERS = "{[("
_CLOSERS = "}])"


class ValueScanner:
    """Scans one value from `start`, resumably: each `advance` goes on where the last stopped,
    so a long value streamed in many deltas is read once.

    A value ends after the bracket or quote that closes it at depth 0; a bare scalar (a
    number, `true`, `None`) ends before the first `,`, closing bracket or whitespace at depth
    0. Brackets are counted, not matched: json.loads or ast.literal_eval judges the text.
    """

    def __init__(self, start: int, is_python: bool) -> None:
        self.pos = start                    # everything before is known to be in the value
        self._start = start
        self._is_python = is_python         # '...' and '''...''' strings as well as "..."
        self._depth = 0
        self._quote: str | None = None      # the delimiter of the string we are in

    def advance(self, text: str, is_final: bool) -> int | None:
        """The value's end (exclusive) once it is known, else None."""
        i, end = self.pos, len(text)
        while i < end:
            char = text[i]
            if self._quote is not None:
                if char == "\\":
                    if i + 1 == end:
                        break               # the escaped character has not arrived
                    i += 2
                elif text.startswith(self._quote, i):
                    i += len(self._quote)
                    self._quote = None
                    if self._depth == 0:
                        self.pos = i
                        return i
                elif len(self._quote) == 3 and self._is_uncertain(text, i, self._quote, is_final):
                    break                   # a quote that may begin the closing triple
                else:
                    i += 1
            elif char == '"' or (self._is_python and char == "'"):
                triple = char * 3
                if self._is_python and self._is_uncertain(text, i, triple, is_final):
                    break                   # '' (empty) or ''' (a triple) not known yet
                self._quote = triple if self._is_python and text.startswith(triple, i) else char
                i += len(self._quote)
            elif char in _OPENERS:
                self._depth += 1
                i += 1
            elif self._depth == 0 and (char in _CLOSERS or char == "," or char.isspace()):
                self.pos = i
                return i                    # the bare scalar ended; the delimiter is not ours
            elif char in _CLOSERS:
                self._depth -= 1
                i += 1
                if self._depth == 0:
                    self.pos = i
                    return i
            else:
                i += 1
        self.pos = i
        is_open = self._quote is not None or self._depth > 0
        return end if is_final and not is_open and end > self._start else None

    @staticmethod
    def _is_uncertain(text: str, index: int, triple: str, is_final: bool) -> bool:
        rest = text[index:index + 3]
        return not is_final and len(rest) < 3 and triple.startswith(rest)
