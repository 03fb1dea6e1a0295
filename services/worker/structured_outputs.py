"""Structured outputs on the worker: a grammar matcher per constrained row of the persistent
batch, and one token bitmask over each step's sampling rows.

- A row's grammar starts compiling (GrammarCache: a background thread, cached) when the row
  is added, so its prefill runs meanwhile; its first sampling waits for it.
- The matcher is built at that first sampling and fed the row's output tokens so far, so a
  request resumed after preemption, or moved here from another engine (its earlier output
  arrives as the tail of its prompt: GrammarSpec.num_resumed_tokens), continues where it was.
- Each step one xgrammar call fills the bitmask rows of the constrained sampling rows; the
  sampler applies them once over the batch, before logprobs (vLLM's order). Then each matcher
  accepts its row's token. The grammar allows EOS only where it may end; a matcher that took
  EOS has terminated, and the scheduler finishes the request on that EOS like any other.
- A grammar that cannot go on (it did not compile here, or a dead end allows no token) fails
  its request alone: the row samples unmasked and its token is not reported, which the
  scheduler already turns into an error for that request ("no token for a complete
  request"). Never the whole step: one bad grammar must not fail every request.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common import wire
from services.common.grammar.grammar_cache import GrammarCache, tokenizer_info
from services.common.metrics import GrammarMetrics

log = structlog.get_logger(__name__)


class GrammarMismatch(RuntimeError):
    """A sampled token its row's grammar does not allow: the mask was not applied."""


@dataclass
class GrammarBitmask:
    """What the sampler masks, by sampling row: a bitmask row (int32, 32 tokens a word) per
    sampling row, the grammar's at `indices` (ascending), all ones elsewhere. The rows at
    `failed` hold a grammar that cannot go on (it did not compile here, or allows no token
    now): they sample unmasked, and the worker reports no token for them, which the
    scheduler turns into an error for that request alone."""
    bitmask: torch.Tensor       # int32 [num sampling rows, ceil(vocab / 32)], CPU
    indices: list[int]
    failed: list[int]
    rejections: dict[int, str] = field(default_factory=dict)  # of `failed`: the grammar's fault


@dataclass
class _GrammarRow:
    compiled: Future[xgr.CompiledGrammar]
    grammar_start: int          # index in the row's tokens of the first one the grammar matches
    matcher: xgr.GrammarMatcher | None = None
    failure: str | None = None  # why the grammar cannot go on
    is_dead_end: bool = False   # the grammar itself allows no token: the request's fault


class StructuredOutputs:
    def __init__(self, load_tokenizer_info: Callable[[], xgr.TokenizerInfo], max_num_reqs: int,
                 vocab_size: int, cache_size: int, metrics: GrammarMetrics | None = None) -> None:
        self._cache = GrammarCache(load_tokenizer_info, cache_size, metrics=metrics)
        self._rows: dict[int, _GrammarRow] = {}
        # NOTE: one preallocated bitmask for every row the batch may hold (~6 KB a row at a
        # 49k vocabulary): no per-step allocation.
        self._bitmask = xgr.allocate_token_bitmask(max_num_reqs, vocab_size)
        self._filler = xgr.BatchGrammarMatcher()

    def add_request(self, row: int, spec: wire.GrammarSpec, grammar_start: int) -> None:
        self._rows[row] = _GrammarRow(self._cache.get(spec), grammar_start)

    def remove_request(self, row: int) -> None:
        self._rows.pop(row, None)

    def fill_bitmask(self, rows: np.ndarray, token_ids: np.ndarray,
                     num_tokens: np.ndarray) -> GrammarBitmask | None:
        """The bitmask of the step's sampling `rows` (in sampling order), None when none of
        them is constrained. token_ids / num_tokens: the persistent batch's columns."""
        if not self._rows:
            return None
        constrained = np.flatnonzero(np.isin(rows, np.fromiter(self._rows, np.int64))).tolist()
        if not constrained:
            return None
        live = [i for i in constrained if self._has_matcher(int(rows[i]), token_ids, num_tokens)]
        self._bitmask[:len(rows)] = -1   # every token allowed, but where a grammar says
        if live:
            self._filler.batch_fill_next_token_bitmask(
                [self._rows[int(rows[i])].matcher for i in live], self._bitmask, live)
            dead_ends = ~self._bitmask[live].any(dim=1).numpy()
            for i in np.asarray(live)[dead_ends].tolist():
                self._bitmask[i] = -1   # sampled unmasked, not reported
                self._fail(int(rows[i]), "its grammar allows no token here: no output can "
                                         "complete it", is_dead_end=True)
        failed = [i for i in constrained if self._rows[int(rows[i])].failure is not None]
        rejections = {i: state.failure for i in failed
                      if (state := self._rows[int(rows[i])]).is_dead_end and state.failure}
        return GrammarBitmask(self._bitmask[:len(rows)],
                              [i for i in constrained if i not in failed], failed, rejections)

    def accept_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Advances the matchers of the constrained `rows` by their sampled tokens."""
        if not self._rows:
            return
        pairs = [(state.matcher, token) for row, token in zip(rows.tolist(), token_ids.tolist())
                 if (state := self._rows.get(row)) is not None and state.failure is None]
        if not pairs:
            return
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs],
                                                              [t for _, t in pairs])
        if not all(accepted):
            raise GrammarMismatch("a sampled token escaped its row's grammar mask")

    def warm(self) -> None:
        self._cache.warm()

    def close(self) -> None:
        self._cache.close()

    def _has_matcher(self, row: int, token_ids: np.ndarray, num_tokens: np.ndarray) -> bool:
        """Builds the row's matcher at its first sampling (waiting for its compile), fed the
        outputs it already has; False when the grammar cannot go on."""
        state = self._rows[row]
        if state.matcher is None and state.failure is None:
            try:
                matcher = xgr.GrammarMatcher(state.compiled.result())
            except Exception as exc:  # noqa: BLE001 - one grammar must not fail the step
                self._fail(row, f"its grammar did not compile on the worker: {exc}")
                return False
            for token in token_ids[row, state.grammar_start:num_tokens[row]].tolist():
                if not matcher.accept_token(token):
                    self._fail(row, f"its earlier output token {token} breaks its grammar")
                    return False
            state.matcher = matcher
        return state.failure is None

    def _fail(self, row: int, reason: str, is_dead_end: bool = False) -> None:
        self._rows[row].failure = reason
        self._rows[row].is_dead_end = is_dead_end
        log.warning("a constrained request cannot go on; it ends with an error", row=row,
                    reason=reason)


def apply_bitmask(logits: torch.Tensor, mask: GrammarBitmask) -> None:
    """Sets the logits of every token a constrained row's grammar forbids to -inf, in one
    pass over the span of constrained rows (the rows between them allow every token).

    NOTE (CPU, 32 constrained rows x 49k vocabulary, benchmarks/structured_outputs.py):
    xgrammar's CPU kernel takes ~200 us a row where few tokens are allowed (the usual case
    outside strings); unpacking the forbidden bits with numpy and one masked copy in place,
    ~40-70 us. On an accelerator, xgrammar's kernel.
    """
    if not mask.indices:
        return
    if logits.device.type != "cpu":
        xgr.apply_token_bitmask_inplace(logits, mask.bitmask.to(logits.device),
                                        indices=mask.indices)
        return
    first, end = mask.indices[0], mask.indices[-1] + 1
    # NOTE: bit j of int32 word w is token 32 w + j; as little-endian bytes, that is
    # unpackbits' little bit order. Inverting the words gives the forbidden bits directly.
    forbidden = np.unpackbits(np.invert(mask.bitmask[first:end].numpy()).view(np.uint8),
                              axis=1, bitorder="little")[:, :logits.shape[1]].view(bool)
    np.copyto(logits[first:end].numpy(), np.float32(-np.inf), where=forbidden)


def load_tokenizer_info(model_dir: Path, vocab_size: int,
                        eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The model's tokenizer as xgrammar sees it: padded to the logits' width, ending on the
    model's EOS ids (the ids the scheduler stops on)."""
    return tokenizer_info(AutoTokenizer.from_pretrained(model_dir), vocab_size, eos_token_ids)
