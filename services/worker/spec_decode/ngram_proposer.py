"""Prompt lookup (vLLM's "ngram" method): drafts copied from the request's own tokens.

For each row, the longest suffix of its tokens (prompt_lookup_max down to prompt_lookup_min
tokens) that occurred earlier is found, and the tokens that followed an earlier occurrence
become the drafts (up to num_speculative_tokens): the most recent occurrence followed by that
many tokens, else the earliest (in a repeating pattern the most recent one is followed by
little more than the suffix itself). One vectorized pass serves the
whole batch: rows are right-aligned in a matrix, and each suffix length adds one comparison
over it, so the cost is prompt_lookup_max numpy operations per step, not a Python loop per
request or token.
"""

from __future__ import annotations

import numpy as np

from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.input_batch import InputBatch
from services.worker.spec_decode.proposer import Proposer

_PAD = -1   # left padding of shorter rows: never equal to a token id


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        num_drafts = np.zeros(len(rows), dtype=np.int32)
        batch.num_draft_tokens[rows] = 0
        num_tokens = batch.num_tokens[rows].astype(np.int64)
        if not len(rows) or int(num_tokens.max()) <= self.min_n:
            return num_drafts
        width = int(num_tokens.max())
        columns = num_tokens[:, None] - width + np.arange(width)
        context = np.where(columns >= 0, batch.token_ids[rows[:, None], np.maximum(columns, 0)],
                           _PAD)
        end, length = self._longest_match(context)
        # The tokens after the match, which may run into the suffix itself (a repeating
        # pattern continues), bounded by the row's room before max_model_len.
        num_drafts[:] = np.minimum.reduce([
            np.full(len(rows), self.num_speculative_tokens), width - 1 - end,
            self.max_model_len - num_tokens])
        num_drafts[length < self.min_n] = 0
        drafted = np.flatnonzero(num_drafts > 0)
        if not len(drafted):
            return num_drafts
        counts = num_drafts[drafted]
        which = np.repeat(drafted, counts)
        offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        tokens = context[which, end[which] + 1 + offsets]
        batch.token_ids[rows[which], num_tokens[which] + offsets] = tokens
        batch.num_draft_tokens[rows[drafted]] = counts
        return num_drafts

    def _longest_match(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row: the end column of the chosen earlier occurrence of its longest matching
        suffix (capped at max_n tokens), and that suffix's length (0: none)."""
        num_rows, width = context.shape
        candidates = context[:, :width - 1]   # an occurrence must be followed by a token
        alive = np.ones(candidates.shape, dtype=bool)
        length = np.zeros(candidates.shape, dtype=np.int8)
        for back in range(min(self.max_n, width - 1)):
            shifted = np.full(candidates.shape, _PAD, dtype=context.dtype)
            shifted[:, back:] = candidates[:, :width - 1 - back]
            suffix_token = context[:, width - 1 - back:width - back]
            alive &= (shifted == suffix_token) & (shifted != _PAD)
            if not alive.any():
                break
            length += alive
        best = length.max(axis=1)
        is_best = length == best[:, None]
        followed = is_best.copy()   # ... by num_speculative_tokens tokens
        followed[:, max(width - self.num_speculative_tokens, 0):] = False
        most_recent = width - 2 - np.argmax(followed[:, ::-1], axis=1)
        earliest = np.argmax(is_best, axis=1)
        return np.where(followed.any(axis=1), most_recent, earliest), best
