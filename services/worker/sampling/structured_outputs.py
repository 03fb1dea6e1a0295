"""Structured outputs on the worker: a grammar matcher per constrained row of the persistent
batch, and one token bitmask over each step's sampling rows.

- A row's grammar starts compiling (GrammarCache: a background thread, cached) when the row
  is added, so its prefill runs meanwhile. A row that reaches a sampling step before its
  compile is done is *deferred*, never waited for (vLLM's WAITING_FOR_FSM): it samples
  nothing this step, and the worker reports it so the scheduler recomputes its last
  position next step. The other rows' step goes on. A compile that failed fails its request.
- The matcher is built at the row's first constrained sampling and fed the row's output
  tokens so far, so a request resumed after preemption, or moved here from another engine
  (its earlier output arrives as the tail of its prompt: GrammarSpec.num_resumed_tokens),
  continues where it was.
- With reasoning markers (GrammarSpec.reasoning), the row samples unmasked until its output
  closes the reasoning section, and the grammar starts after it (reasoning_gate.py).
- Each step one xgrammar call fills the bitmask rows of the constrained sampling rows; the
  sampler applies them once over the batch, before logprobs (vLLM's order). Then each matcher
  accepts its row's token. The grammar allows EOS only where it may end; a matcher that took
  EOS has terminated, and the scheduler finishes the request on that EOS like any other.
- Speculative decoding: a row's drafts are cut at the first its grammar refuses, and before
  one that would end it (`trim_drafts`, when they are proposed); at the next step each draft
  position is masked by the grammar's state after the drafts before it (accepted, masked,
  rolled back), so a draft is accepted only where the grammar allows it and every emitted
  token is one the row would have sampled one at a time.
- A grammar that cannot go on (it did not compile here, or a dead end allows no token) fails
  its request alone: the row samples unmasked and its token is not reported, which the
  scheduler already turns into an error for that request ("no token for a complete
  request"). Never the whole step: one bad grammar must not fail every request.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from services.common import wire_pb
from services.common.grammar.grammar_cache import GrammarCache, tokenizer_info
from services.common.metrics import GrammarMetrics
from services.worker.sampling.reasoning_gate import ReasoningGate

log = structlog.get_logger(__name__)


class _Status(enum.Enum):
    """A constrained row at a sampling step."""
    LIVE = enum.auto()        # the grammar masks it
    UNDECIDED = enum.auto()   # the grammar, or the start of a reasoning section
    FREE = enum.auto()        # reasoning: unmasked
    DEFERRED = enum.auto()    # its grammar is still compiling
    FAILED = enum.auto()      # its grammar cannot go on


class GrammarMismatch(RuntimeError):
    """A sampled token its row's grammar does not allow: the mask was not applied."""


@dataclass
class GrammarBitmask:
    """What the sampler masks, by sampling row: a bitmask row (int32, 32 tokens a word) per
    sampling row, the grammar's at `indices` (ascending), all ones elsewhere. The rows at
    `failed` hold a grammar that cannot go on (it did not compile here, or allows no token
    now): they sample unmasked, and the worker reports no token for them, which the
    scheduler turns into an error for that request alone. The rows at `deferred` wait for
    their compile: they sample unmasked, and their token is dropped."""
    bitmask: torch.Tensor       # int32 [num sampling rows, ceil(vocab / 32)], CPU
    indices: list[int]
    failed: list[int]
    rejections: dict[int, str] = field(default_factory=dict)  # of `failed`: the grammar's fault
    deferred: list[int] = field(default_factory=list)


@dataclass
class _GrammarRow:
    compiled: Future[xgr.CompiledGrammar]
    grammar_start: int          # index in the row's tokens of the first one the grammar matches
    gate: ReasoningGate | None = None   # moves grammar_start past a reasoning section
    matcher: xgr.GrammarMatcher | None = None   # built when first needed; none while undecided
    also_allowed: int | None = None   # undecided: the reasoning start marker's next token
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

    def add_request(self, row: int, spec: wire_pb.GrammarSpec, output_start: int) -> None:
        """`output_start`: the index of the row's first output token (a moved request's
        earlier outputs are the end of its prompt)."""
        gate = (ReasoningGate(spec.reasoning, output_start)
                if spec.reasoning.end_token_ids else None)
        self._rows[row] = _GrammarRow(self._cache.get(spec), output_start, gate)

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
        self._bitmask[:len(rows)] = -1   # every token allowed, but where a grammar says
        mask = GrammarBitmask(self._bitmask[:len(rows)], [], [])
        live, undecided = [], []
        # A row's first sampling position here; its draft positions follow it.
        for i in (i for i in constrained if i == 0 or rows[i - 1] != rows[i]):
            row = int(rows[i])
            status = self._prepare(row, token_ids[row, :num_tokens[row]])
            if status is _Status.LIVE:
                live.append(i)
            elif status is _Status.UNDECIDED:
                undecided.append(i)
                self._fill_undecided(row, i, token_ids[row, :num_tokens[row]])
            elif status is _Status.DEFERRED:
                mask.deferred.append(i)
        if live:
            self._filler.batch_fill_next_token_bitmask(
                [self._rows[int(rows[i])].matcher for i in live], self._bitmask, live)
            dead_ends = ~self._bitmask[live].any(dim=1).numpy()
            for i in np.asarray(live)[dead_ends].tolist():
                self._bitmask[i] = -1   # sampled unmasked, not reported
                self._fail(int(rows[i]), "its grammar allows no token here: no output can "
                                         "complete it", is_dead_end=True)
            live += self._fill_draft_positions(rows, live, token_ids, num_tokens)
        mask.failed = [i for i in constrained if self._rows[int(rows[i])].failure is not None]
        mask.rejections = {i: state.failure for i in mask.failed
                           if (state := self._rows[int(rows[i])]).is_dead_end and state.failure}
        mask.indices = sorted(i for i in live + undecided if i not in mask.failed)
        return mask

    def accept_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Advances the matchers of the constrained `rows` by their sampled tokens (a row
        that accepted drafts appears once per token, in order)."""
        if not self._rows:
            return
        pairs = [(state.matcher, token) for row, token in zip(rows.tolist(), token_ids.tolist())
                 if (state := self._rows.get(row)) is not None and state.failure is None
                 and state.matcher is not None and not state.matcher.is_terminated()]
        if not pairs:
            return
        matchers = [m for m, _ in pairs]
        if len({id(m) for m in matchers}) == len(matchers):
            accepted = xgr.BatchGrammarMatcher.batch_accept_token(matchers,
                                                                  [t for _, t in pairs])
        else:   # one matcher takes several tokens: in order
            accepted = [matcher.accept_token(token) for matcher, token in pairs]
        if not all(accepted):
            raise GrammarMismatch("a sampled token escaped its row's grammar mask")

    def trim_drafts(self, rows: np.ndarray, num_drafts: np.ndarray, token_ids: np.ndarray,
                    num_tokens: np.ndarray) -> np.ndarray:
        """The drafts each of `rows` keeps (they lie after its `num_tokens` in `token_ids`):
        a constrained row's are cut at the first its grammar refuses, and before one that
        ends it (the position after an ending has no mask to sample under). A row whose
        grammar is not live (compiling, failed) keeps none."""
        if not self._rows:
            return num_drafts
        kept = num_drafts.copy()
        for i in np.flatnonzero(num_drafts).tolist():
            row = int(rows[i])
            if (state := self._rows.get(row)) is None:
                continue
            matcher = state.matcher
            if matcher is None or state.failure is not None:
                kept[i] = 0
                continue
            start = int(num_tokens[row])
            valid = 0
            for token in token_ids[row, start:start + int(num_drafts[i])].tolist():
                if not matcher.accept_token(token):
                    break
                if matcher.is_terminated():
                    matcher.rollback(1)
                    break
                valid += 1
            if valid:
                matcher.rollback(valid)
            kept[i] = valid
        return kept

    def wait_compiled(self, timeout_s: float | None = None) -> None:
        """Until every row's grammar has compiled (or failed). For benchmarks and tests: a
        step never waits, it defers the rows still compiling."""
        futures.wait([state.compiled for state in self._rows.values()], timeout_s)

    def warm(self) -> None:
        self._cache.warm()

    def close(self) -> None:
        self._cache.close()

    def _prepare(self, row: int, tokens: np.ndarray) -> _Status:
        """What the row's grammar does at this sampling step (`tokens`: the row's so far).
        Builds the matcher at the row's first constrained sampling, fed its outputs so far."""
        state = self._rows[row]
        if state.failure is not None:
            return _Status.FAILED
        if state.gate is not None:
            start = state.gate.grammar_start(tokens)
            if start.index is None:
                return _Status.FREE
            if start.index != state.grammar_start:
                state.grammar_start, state.matcher = start.index, None
            state.also_allowed = start.also_allowed
        if state.matcher is not None:
            # NOTE: an ended grammar's request ended on its stop token; with async scheduling
            # its row may run one more step, whose token the scheduler drops.
            return _Status.FREE if state.matcher.is_terminated() else _Status.LIVE
        if not state.compiled.done():
            return _Status.DEFERRED
        try:
            compiled = state.compiled.result()
        except Exception as exc:  # noqa: BLE001 - one grammar must not fail the step
            self._fail(row, f"its grammar did not compile on the worker: {exc}")
            return _Status.FAILED
        if state.also_allowed is not None:
            return _Status.UNDECIDED
        state.matcher = _replayed(compiled, tokens[state.grammar_start:])
        if state.matcher is None:
            self._fail(row, "its earlier output breaks its grammar")
            return _Status.FAILED
        return _Status.LIVE

    def _fill_draft_positions(self, rows: np.ndarray, live: list[int], token_ids: np.ndarray,
                              num_tokens: np.ndarray) -> list[int]:
        """Masks the draft positions after each live row's first (`live`): position j by the
        grammar after drafts 0..j-1, which the matcher takes and then gives back. Returns
        the positions masked. A draft the grammar refuses (trim_drafts keeps none) is never
        sampled there, so it is rejected and no later position is emitted: theirs stay
        unmasked."""
        masked = []
        for first in live:
            row = int(rows[first])
            state = self._rows[row]
            end = first + 1
            while end < len(rows) and rows[end] == row:
                end += 1
            if end == first + 1 or state.failure is not None:
                continue
            assert state.matcher is not None
            start = int(num_tokens[row])
            taken = 0
            for token in token_ids[row, start:start + end - first - 1].tolist():
                if not state.matcher.accept_token(token):
                    break
                taken += 1
                state.matcher.fill_next_token_bitmask(self._bitmask, first + taken)
                masked.append(first + taken)
            if taken:
                state.matcher.rollback(taken)
        return masked

    def _fill_undecided(self, row: int, index: int, tokens: np.ndarray) -> None:
        """The mask of a row whose output may still open a reasoning section: the grammar's
        tokens (while its output so far is in the grammar), and the start marker's next.
        NOTE: the matcher is replayed each such step (a marker is a token or a few), so
        accepting a token never has to undo one."""
        state = self._rows[row]
        assert state.also_allowed is not None
        matcher = _replayed(state.compiled.result(), tokens[state.grammar_start:])
        if matcher is not None:
            matcher.fill_next_token_bitmask(self._bitmask, index)
        else:
            self._bitmask[index] = 0
        words = self._bitmask[index].numpy().view(np.uint32)
        words[state.also_allowed // 32] |= np.uint32(1 << (state.also_allowed % 32))

    def _fail(self, row: int, reason: str, is_dead_end: bool = False) -> None:
        self._rows[row].failure = reason
        self._rows[row].is_dead_end = is_dead_end
        log.warning("a constrained request cannot go on; it ends with an error", row=row,
                    reason=reason)


def _replayed(compiled: xgr.CompiledGrammar, tokens: np.ndarray) -> xgr.GrammarMatcher | None:
    """A matcher that accepted `tokens`; None when the grammar does not take them."""
    matcher = xgr.GrammarMatcher(compiled)
    if all(matcher.accept_token(token) for token in tokens.tolist()):
        return matcher
    return None


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
