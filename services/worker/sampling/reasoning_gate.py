"""Where a constrained row's grammar starts when the model reasons first (--reasoning-parser):
after the reasoning section of its output, as vLLM's structured outputs with a reasoner.

The markers arrive as token ids (ReasoningMarkers, resolved by the tokenizer), and the
section is found by those ids in the row's tokens:
- opens_in_prompt (deepseek_r1): the output reasons from its first token; the grammar
  starts at the token after the first `end` sequence.
- otherwise (qwen3): an output that opens with the `start` sequence reasons until `end`;
  any other output is constrained from its first token. While the output is still a proper
  start of `start`, either may happen, so the next `start` token is allowed beside the
  grammar's tokens.

NOTE: a marker is matched as the tokenizer writes it (one special token in the Qwen3 and
DeepSeek-R1 vocabularies); a model spelling it with other tokens keeps reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common import wire_pb
from services.common.packing import unpack_int32


@dataclass(frozen=True)
class GrammarStart:
    """Where the grammar starts in the row's tokens (None: the row is reasoning, unmasked).
    `also_allowed`: a token allowed beside the grammar's (the next token of `start` while
    the output may still be opening a reasoning section)."""
    index: int | None
    also_allowed: int | None = None


REASONING = GrammarStart(None)


class ReasoningGate:
    def __init__(self, markers: wire_pb.ReasoningMarkers, output_start: int) -> None:
        self._start = unpack_int32(markers.start_token_ids).tolist()
        self._end = unpack_int32(markers.end_token_ids)
        if not len(self._end):
            raise ValueError("a reasoning section needs the token ids of its end marker")
        if not markers.opens_in_prompt and not self._start:
            raise ValueError("a reasoning section opened by the output needs the token ids "
                             "of its start marker")
        self._output_start = output_start
        # Where the reasoning text begins (None: not known yet), and how far it was searched.
        self._reasoning_from: int | None = output_start if markers.opens_in_prompt else None
        self._searched_to = output_start
        self._found: GrammarStart | None = None

    def grammar_start(self, tokens: np.ndarray) -> GrammarStart:
        """`tokens`: the row's tokens so far (prompt, then outputs). Once the grammar starts,
        it stays where it started."""
        if self._found is not None:
            return self._found
        if self._reasoning_from is None:
            opening = self._opening(tokens[self._output_start:].tolist())
            if opening is not None:
                return opening
        assert self._reasoning_from is not None
        end = len(self._end)
        # NOTE: only what is new since the last call is searched (an end sequence may
        # straddle the two), so a long reasoning costs O(1) a step.
        search_from = max(self._reasoning_from, self._searched_to - end + 1)
        self._searched_to = len(tokens)
        at = _find(tokens[search_from:], self._end)
        if at is None:
            return REASONING
        self._found = GrammarStart(search_from + at + end)
        return self._found

    def _opening(self, outputs: list[int]) -> GrammarStart | None:
        """qwen3: what the output's first tokens decide (None: it opened a section)."""
        start = self._start
        num = min(len(outputs), len(start))
        if outputs[:num] != start[:num]:
            self._found = GrammarStart(self._output_start)
            return self._found
        if len(outputs) < len(start):
            return GrammarStart(self._output_start, also_allowed=start[len(outputs)])
        self._reasoning_from = self._searched_to = self._output_start + len(start)
        return None


def _find(tokens: np.ndarray, sequence: np.ndarray) -> int | None:
    """The index of the first occurrence of `sequence` in `tokens`."""
    length = len(sequence)
    if len(tokens) < length:
        return None
    windows = np.lib.stride_tricks.sliding_window_view(tokens, length)
    hits = np.flatnonzero((windows == sequence).all(axis=1))
    return int(hits[0]) if len(hits) else None
