"""Stop strings over streamed text.

A stop string may arrive split across tokens, so while stop strings are set the last
(longest stop - 1) characters are held back until more text shows they are not the start
of a stop string (as vLLM does). The stop string itself is not returned unless asked.
With `min_tokens`, a stop string counts only if it ends after the text of the first
`min_tokens` tokens (vLLM's rule: stop strings are not checked before then).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stops: Sequence[str], include_stop_str_in_output: bool = False,
                 min_tokens: int = 0) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stops), default=1) - 1
        self.min_tokens = min_tokens
        self._text = ""
        self._emitted = 0
        self._min_end = 0      # a match must end after this (the first min_tokens' text)

    def append(self, new_text: str, num_tokens: int | None = None) -> tuple[str, str | None]:
        """Adds text, which brings the output to `num_tokens` tokens; returns (text safe to
        emit now, the stop string matched or None)."""
        search_from = max(0, len(self._text) - self.hold_back)
        self._text += new_text
        if num_tokens is not None and num_tokens <= self.min_tokens:
            self._min_end = len(self._text)
        match = self._earliest_match(search_from)
        if match is not None:
            index, stop = match
            end = index + len(stop) if self.include_stop else index
            emit = self._text[self._emitted:max(end, self._emitted)]
            self._emitted = len(self._text)
            return emit, stop
        safe_end = max(self._emitted, len(self._text) - self.hold_back)
        emit = self._text[self._emitted:safe_end]
        self._emitted = safe_end
        return emit, None

    def resume(self, text: str, num_emitted: int, min_end: int = 0) -> None:
        """Restores the state after `text`, of which the first `num_emitted` characters
        were emitted (text before that point held no stop string) and the first `min_end`
        were the first min_tokens' text."""
        self._text = text
        self._emitted = min(num_emitted, len(text))
        self._min_end = min(min_end, len(text))

    def flush(self) -> str:
        """The held-back text, once the request has ended for another reason."""
        emit = self._text[self._emitted:]
        self._emitted = len(self._text)
        return emit

    def _earliest_match(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self.stops:
            index = self._text.find(stop, max(search_from, self._min_end - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best
