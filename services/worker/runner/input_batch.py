"""The persistent batch: one row per live request, updated in place by each step's diffs.

vLLM's InputBatch idea: token ids, counts, the block table and sampling parameters live in
preallocated numpy columns indexed by row, so preparing a step is a few vectorized gathers
instead of rebuilding per-request objects. A row is taken when a request arrives and given back
when it finishes; rows never move, so nothing needs condensing.
"""

from __future__ import annotations

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import unpack_float32, unpack_int32
from services.worker.sampling.structured_outputs import StructuredOutputs

NO_LOGPROBS = -1


class InputBatchError(ValueError):
    """A step diff the worker cannot apply (unknown handle, no free row, too long...)."""


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 eos_token_ids: list[int], device: torch.device,
                 structured_outputs: StructuredOutputs | None = None):
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.eos_token_ids = np.asarray(eos_token_ids, dtype=np.int32)
        self.device = device
        # NOTE: one spare column: a request whose last computed position is max_model_len - 1
        # still samples (and appends) one more token before the scheduler stops it.
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # Speculative decoding: drafts proposed for the row, in token_ids right after its
        # num_tokens known tokens (scratch space: the next tokens overwrite them).
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.can_speculate = np.zeros(max_num_reqs, dtype=bool)
        self.lora_ids = np.zeros(max_num_reqs, dtype=np.int32)   # 0: the base model
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Sampling parameters, one column each ("off" values make a row a no-op).
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)
        self.num_prompt_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)
        # Rare per-row extras, keyed by row.
        self.generators: dict[int, torch.Generator] = {}
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.min_tokens_stop_ids: dict[int, np.ndarray] = {}
        self.structured_outputs = structured_outputs   # grammar matchers of constrained rows
        self.handle_to_row: dict[int, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    @property
    def num_reqs(self) -> int:
        return len(self.handle_to_row)

    def rows_of(self, handles: list[int] | np.ndarray) -> np.ndarray:
        try:
            return np.fromiter((self.handle_to_row[h] for h in handles), dtype=np.int64,
                               count=len(handles))
        except KeyError as e:
            raise InputBatchError(f"unknown request handle {e.args[0]}") from None

    def add_request(self, new: wire_pb.NewRequestData) -> None:
        if new.handle in self.handle_to_row:
            self.remove_request(new.handle)  # resumed under the same handle: start over
        if not self._free_rows:
            raise InputBatchError(f"more than max_num_seqs={self.max_num_reqs} live requests")
        token_ids = unpack_int32(new.token_ids)
        block_ids = unpack_int32(new.block_ids)
        if len(token_ids) > self.max_model_len:
            raise InputBatchError(f"request {new.request_id} has {len(token_ids)} tokens, "
                                  f"over max_model_len={self.max_model_len}")
        if len(block_ids) > self.block_table.shape[1]:
            raise InputBatchError(f"request {new.request_id} has too many blocks")
        sampling = new.sampling
        output_start = self._output_start(sampling.grammar, new.num_prompt_tokens)
        row = self._free_rows.pop()
        self.handle_to_row[new.handle] = row
        self.token_ids[row, :len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_draft_tokens[row] = 0
        self.lora_ids[row] = new.lora.lora_id   # 0 (the base model) when unset
        self.block_table[row, :len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self._set_sampling(row, sampling, has_outputs=len(token_ids) > new.num_prompt_tokens)
        if output_start is not None:
            assert self.structured_outputs is not None
            self.structured_outputs.add_request(row, sampling.grammar, output_start)
            # NOTE: a reasoning section's end marker may fall among the drafts, and the
            # positions after it would need the grammar's mask: such rows do not speculate.
            if sampling.grammar.reasoning.end_token_ids:
                self.can_speculate[row] = False

    def remove_request(self, handle: int) -> None:
        row = self.handle_to_row.pop(handle, None)
        if row is None:
            return  # finished before the worker ever saw it (aborted while waiting)
        self.generators.pop(row, None)
        self.logit_bias.pop(row, None)
        self.min_tokens_stop_ids.pop(row, None)
        if self.structured_outputs is not None:
            self.structured_outputs.remove_request(row)
        self._free_rows.append(row)

    def reset(self) -> None:
        """Drops every row (the scheduler started afresh)."""
        for handle in list(self.handle_to_row):
            self.remove_request(handle)

    def update_cached(self, handles: np.ndarray, num_new_blocks: np.ndarray,
                      new_block_ids: np.ndarray, num_computed_tokens: np.ndarray) -> None:
        """Appends new blocks to the block tables and takes the scheduler's computed counts."""
        rows = self.rows_of(handles)
        if len(num_new_blocks) and num_new_blocks.any():
            starts = np.concatenate(([0], np.cumsum(num_new_blocks)))
            for row, start, end in zip(rows.tolist(), starts[:-1].tolist(), starts[1:].tolist()):
                if start == end:
                    continue
                first = self.num_blocks[row]
                if first + end - start > self.block_table.shape[1]:
                    raise InputBatchError(f"request handle row {row} exceeds max_model_len")
                self.block_table[row, first:first + end - start] = new_block_ids[start:end]
                self.num_blocks[row] = first + end - start
        if len(num_computed_tokens):
            self.num_computed_tokens[rows] = num_computed_tokens

    def append_sampled(self, rows: np.ndarray, token_ids: np.ndarray,
                       deferred: list[int] | None = None,
                       emitted: np.ndarray | None = None) -> None:
        """Appends each sampling row's token, but at `deferred` (indices into `rows`: rows
        waiting for their grammar), whose last position is uncounted instead: the scheduler
        schedules it again, and the step that recomputes it samples again. A row that
        verified drafts appears once per position, consecutively; `emitted` (a mask over
        `rows`) keeps the tokens the verifier accepted, appended in order."""
        keep = np.ones(len(rows), dtype=bool) if emitted is None else emitted.copy()
        if deferred:
            waiting = rows[deferred]
            self.num_computed_tokens[waiting] -= 1
            # NOTE: a row that sampled has computed its whole prompt, so its prompt logprobs
            # are sent; recomputing the prompt's last position must not send them again.
            self.num_prompt_logprobs[waiting] = NO_LOGPROBS
            keep[deferred] = False
        if not keep.all():
            rows, token_ids = rows[keep], token_ids[keep]
        self.token_ids[rows, self.num_tokens[rows] + offsets_in_runs(rows)] = token_ids
        np.add.at(self.num_tokens, rows, 1)
        if self.structured_outputs is not None:
            self.structured_outputs.accept_tokens(rows, token_ids)

    def _output_start(self, grammar: wire_pb.GrammarSpec, num_prompt_tokens: int) -> int | None:
        """Where a constrained request's output starts in its tokens (None: unconstrained):
        after the prompt, less the outputs a moved request brings in its prompt."""
        if grammar.kind == wire_pb.GrammarKind.GRAMMAR_KIND_NONE:
            return None
        if self.structured_outputs is None:
            raise InputBatchError("this worker was built without structured outputs")
        if not 0 <= grammar.num_resumed_tokens <= num_prompt_tokens:
            raise InputBatchError(f"num_resumed_tokens {grammar.num_resumed_tokens} is outside "
                                  f"the prompt")
        return num_prompt_tokens - grammar.num_resumed_tokens

    def _set_sampling(self, row: int, sp: wire_pb.SamplingParams, has_outputs: bool) -> None:
        # NOTE: proto3 zero values mean "unset"; map them (and out-of-range values) to "off".
        self.temperature[row] = max(sp.temperature, 0.0)
        self.top_p[row] = sp.top_p if 0.0 < sp.top_p < 1.0 else 1.0
        self.top_k[row] = max(sp.top_k, 0)
        self.min_p[row] = sp.min_p if 0.0 < sp.min_p <= 1.0 else 0.0
        self.repetition_penalty[row] = sp.repetition_penalty if sp.repetition_penalty > 0 else 1.0
        self.presence_penalty[row] = sp.presence_penalty
        self.frequency_penalty[row] = sp.frequency_penalty
        self.min_tokens[row] = sp.min_tokens
        wants_logprobs = sp.HasField("logprobs")
        self.num_logprobs[row] = sp.logprobs if wants_logprobs else NO_LOGPROBS
        # NOTE: a request resumed after preemption with outputs already sent its prompt
        # logprobs before; recomputing its prompt must not send them twice.
        wants_prompt_logprobs = sp.HasField("prompt_logprobs") and not has_outputs
        self.num_prompt_logprobs[row] = sp.prompt_logprobs if wants_prompt_logprobs else NO_LOGPROBS
        # NOTE: drafts are verified where one token's logprobs are reported per step.
        # Penalties count the drafts before each position (sampling_metadata), and grammars
        # mask each draft position (structured_outputs), so those rows speculate.
        self.can_speculate[row] = not wants_logprobs
        if sp.HasField("seed"):
            self.generators[row] = torch.Generator(self.device).manual_seed(sp.seed)
        if sp.logit_bias_token_ids:
            self.logit_bias[row] = (unpack_int32(sp.logit_bias_token_ids).astype(np.int64),
                                    unpack_float32(sp.logit_bias_values))
        if sp.min_tokens > 0:
            stop_ids = unpack_int32(sp.stop_token_ids)
            if not sp.ignore_eos:
                stop_ids = np.concatenate((stop_ids, self.eos_token_ids))
            self.min_tokens_stop_ids[row] = np.unique(stop_ids).astype(np.int64)


def concat_ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[starts[0], ..., starts[0] + counts[0] - 1, starts[1], ...] without a Python loop."""
    total = int(counts.sum())
    run_starts = np.cumsum(counts) - counts
    return np.repeat(starts - run_starts, counts) + np.arange(total)


def offsets_in_runs(rows: np.ndarray) -> np.ndarray:
    """Each entry's index within its run of equal consecutive rows (0 for a lone row)."""
    if len(rows) < 2:
        return np.zeros(len(rows), dtype=np.int64)
    index = np.arange(len(rows))
    run_start = np.r_[True, rows[1:] != rows[:-1]]
    return index - np.maximum.accumulate(np.where(run_start, index, 0))
