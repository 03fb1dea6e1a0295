"""Suffix decoding (vLLM's "suffix" method, after Arctic's SuffixDecoding): drafts from the
request's own tokens and from the outputs of recent requests, as long as the match earns.

For each row, the longest suffix of its context (up to suffix_decoding_max_tree_depth tokens)
is matched in two sources: the row's own tokens, and a bounded cache of finished requests'
outputs (agents re-emit the same JSON and code across requests). From all occurrences of
that suffix, the draft follows the most frequent continuation token by token; each token's
probability is estimated as its share of the occurrences still agreeing, and the path stops
once the product falls below suffix_decoding_min_token_prob. The draft is at most
suffix_decoding_max_spec_factor x the match length long (adaptive: a long match earns a long
draft), and the source whose path has the higher expected number of accepted tokens wins.

NOTE (cost): one Python loop over the rows that may speculate, each a handful of numpy
operations on shrinking candidate arrays; the cache is one array rebuilt at most once a step
and bounded by _MAX_CACHED_TOKENS, since each row scans it once (measured on 2 CPU cores with
a 64k-token cache: ~0.09 ms a row, 5.9 ms for 64 rows; the bound halves that).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from services.common.speculative_config import SpeculativeConfig
from services.worker.runner.input_batch import InputBatch
from services.worker.spec_decode.proposer import Proposer

_END = -1                       # separates cached outputs: never equal to a token id
_MAX_CACHED_TOKENS = 1 << 15


class SuffixProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.max_model_len = max_model_len
        self._outputs: deque[np.ndarray] = deque()
        self._num_cached_tokens = 0
        self._corpus: np.ndarray | None = None   # the outputs joined; None: to rebuild

    def remember(self, batch: InputBatch, rows: list[int]) -> None:
        """Keeps the outputs of requests whose rows are about to go (they finished, or were
        preempted: either way, text the model produced)."""
        if not self.max_cached_requests:
            return
        for row in rows:
            output = batch.token_ids[row, batch.num_prompt_tokens[row]:batch.num_tokens[row]]
            if not len(output):
                continue
            self._outputs.append(output.astype(np.int64))
            self._num_cached_tokens += len(output) + 1
            while (len(self._outputs) > self.max_cached_requests
                   or self._num_cached_tokens > _MAX_CACHED_TOKENS):
                self._num_cached_tokens -= len(self._outputs.popleft()) + 1
            self._corpus = None

    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        num_drafts = np.zeros(len(rows), dtype=np.int32)
        batch.num_draft_tokens[rows] = 0
        corpus = self._joined_outputs()
        for i, row in enumerate(rows.tolist()):
            num_tokens = int(batch.num_tokens[row])
            context = batch.token_ids[row, :num_tokens].astype(np.int64)
            room = min(self.num_speculative_tokens, self.max_model_len - num_tokens)
            drafts, score = self._draft(context, context, room)
            if len(corpus):
                cached, cached_score = self._draft(corpus, context, room)
                if cached_score > score:
                    drafts = cached
            if drafts:
                batch.token_ids[row, num_tokens:num_tokens + len(drafts)] = drafts
                batch.num_draft_tokens[row] = num_drafts[i] = len(drafts)
        return num_drafts

    def _joined_outputs(self) -> np.ndarray:
        if self._corpus is None:
            parts = [part for output in self._outputs for part in (output, [_END])]
            self._corpus = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._corpus

    def _draft(self, text: np.ndarray, context: np.ndarray, room: int
               ) -> tuple[list[int], float]:
        """The draft `text` suggests after `context`, and its expected accepted tokens."""
        ends, depth = self._longest_match(text, context)
        max_len = min(room, int(self.max_spec_factor * depth))
        drafts: list[int] = []
        prob, score = 1.0, 0.0
        for offset in range(1, max_len + 1):
            follow = ends + offset
            follow = follow[follow < len(text)]
            following = text[follow]
            following = following[following != _END]
            if not len(following):
                break
            values, counts = np.unique(following, return_counts=True)
            best = int(np.argmax(counts))
            prob *= counts[best] / len(ends)
            if prob < self.min_token_prob:
                break
            drafts.append(int(values[best]))
            score += prob
            ends = follow[text[follow] == values[best]] - offset
        return drafts, score

    def _longest_match(self, text: np.ndarray, context: np.ndarray) -> tuple[np.ndarray, int]:
        """Where in `text` the longest suffix of `context` (up to max_depth tokens) ends,
        followed by at least one position, and that suffix's length (0: none)."""
        # NOTE: an occurrence ending at the text's last position has nothing to follow it
        # (in the row's own tokens, that is the suffix itself).
        ends = np.flatnonzero(text[:-1] == context[-1])
        if not len(ends):
            return ends, 0
        depth = 1
        while depth < min(self.max_depth, len(context)):
            earlier = ends[ends >= depth]
            earlier = earlier[text[earlier - depth] == context[-1 - depth]]
            if not len(earlier):
                break
            ends, depth = earlier, depth + 1
        return ends, depth
