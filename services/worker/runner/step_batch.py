"""One step's flattened varlen batch, prepared from the persistent batch with numpy.

Requests are reordered decodes first (one query token each), then prefill chunks, so attention
backends find all decode rows in one contiguous slice. Everything is vectorized over tokens:
positions, input ids and slots are gathers from the persistent batch's columns.

Speculative decoding: a request's draft tokens sit in its row right after its known tokens,
so a step scheduled past the known tokens runs them as extra query positions (a decode of
1 + d tokens looks like a short prefill chunk to attention), and the request samples at each
of its last d + 1 positions; the verifier (spec_decode/) keeps what the target model accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import unpack_int32
from services.worker.attention.backend import CommonAttentionMetadata
from services.worker.runner.input_batch import (
    NO_LOGPROBS,
    InputBatch,
    InputBatchError,
    concat_ranges,
)


@dataclass
class PromptLogprobsChunk:
    handle: int
    target_token_ids: np.ndarray  # prompt tokens whose logprob each row gives
    num_top: int
    is_last_chunk: bool


@dataclass
class StepBatch:
    handles: np.ndarray          # int32 [N], decodes first
    rows: np.ndarray             # int64 [N]: persistent-batch rows
    seq_lens: np.ndarray         # int32 [N]: computed tokens after this step
    input_ids: torch.Tensor      # int64 [T]
    positions: torch.Tensor      # int64 [T]
    attn: CommonAttentionMetadata
    sampling_index: np.ndarray   # indices into N of the requests that sample, in order
    num_draft_tokens: np.ndarray  # int64, per sampling request: drafts it verifies
    logits_indices: torch.Tensor  # int64: hidden rows to compute logits for (sampling
    # positions first: each sampling request's last 1 + drafts positions, in order)
    prompt_logprobs: list[PromptLogprobsChunk]

    @property
    def num_tokens(self) -> int:
        return self.attn.num_actual_tokens

    @property
    def is_decode_only(self) -> bool:
        return self.attn.num_decodes == self.attn.num_reqs

    @property
    def num_sample_positions(self) -> np.ndarray:
        """Per sampling request: the positions it samples at (1 + its drafts)."""
        return self.num_draft_tokens + 1


def prepare_step_batch(step: wire_pb.StepInput, batch: InputBatch, block_size: int,
                       device: torch.device) -> StepBatch | None:
    """The batch to run for `step` (None when nothing is scheduled)."""
    handles = np.concatenate((np.fromiter((n.handle for n in step.new_requests), np.int32,
                                          len(step.new_requests)),
                              unpack_int32(step.cached_handles)))
    num_scheduled = unpack_int32(step.num_scheduled_tokens)
    if len(num_scheduled) != len(handles):
        raise InputBatchError(f"{len(num_scheduled)} num_scheduled_tokens for "
                              f"{len(handles)} requests")
    scheduled = np.flatnonzero(num_scheduled > 0)
    if not len(scheduled):
        return None
    # NOTE: a stable sort keeps message order within decodes and within prefills.
    order = scheduled[np.argsort(num_scheduled[scheduled] != 1, kind="stable")]
    handles, query_lens = handles[order], num_scheduled[order].astype(np.int64)
    rows = batch.rows_of(handles)
    num_computed = batch.num_computed_tokens[rows].astype(np.int64)
    seq_lens = num_computed + query_lens
    _validate(batch, rows, seq_lens, block_size)

    num_reqs, num_tokens = len(rows), int(query_lens.sum())
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    token_to_req = np.repeat(np.arange(num_reqs), query_lens)
    positions = (np.repeat(num_computed - query_start_loc[:-1], query_lens)
                 + np.arange(num_tokens))
    token_rows = rows[token_to_req]
    input_ids = batch.token_ids[token_rows, positions].astype(np.int64)
    block_ids = batch.block_table[token_rows, positions // block_size].astype(np.int64)
    slot_mapping = block_ids * block_size + positions % block_size
    max_blocks = -(-int(seq_lens.max()) // block_size)
    num_decodes = int(np.count_nonzero(query_lens == 1))

    # A request samples once it runs up to its known tokens; past them it verifies drafts.
    num_past_known = seq_lens - batch.num_tokens[rows]
    sampling_index = np.flatnonzero(num_past_known >= 0)
    num_drafts = num_past_known[sampling_index]
    ends = query_start_loc[1:][sampling_index]
    logits_rows = [concat_ranges(ends - num_drafts - 1, num_drafts + 1)
                   if num_drafts.any() else ends - 1]
    prompt_chunks = _prompt_logprobs(batch, handles, rows, num_computed, seq_lens,
                                     query_start_loc, logits_rows)

    def to_device(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    attn = CommonAttentionMetadata(
        num_reqs=num_reqs, num_actual_tokens=num_tokens, num_decodes=num_decodes,
        max_query_len=int(query_lens.max()),
        query_start_loc=to_device(query_start_loc, torch.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens=to_device(seq_lens, torch.int32), seq_lens_cpu=seq_lens,
        block_table=to_device(batch.block_table[rows, :max_blocks], torch.int32),
        slot_mapping=to_device(slot_mapping, torch.int64))
    return StepBatch(
        handles=handles, rows=rows, seq_lens=seq_lens.astype(np.int32),
        input_ids=to_device(input_ids, torch.int64), positions=to_device(positions, torch.int64),
        attn=attn, sampling_index=sampling_index, num_draft_tokens=num_drafts,
        logits_indices=to_device(np.concatenate(logits_rows), torch.int64),
        prompt_logprobs=prompt_chunks)


def _validate(batch: InputBatch, rows: np.ndarray, seq_lens: np.ndarray,
              block_size: int) -> None:
    if (seq_lens > batch.num_tokens[rows] + batch.num_draft_tokens[rows]).any():
        raise InputBatchError("scheduled past a request's known tokens and drafts")
    if (-(-seq_lens // block_size) > batch.num_blocks[rows]).any():
        raise InputBatchError("scheduled tokens without KV blocks for them")


def _prompt_logprobs(batch: InputBatch, handles: np.ndarray, rows: np.ndarray,
                     num_computed: np.ndarray, seq_lens: np.ndarray,
                     query_start_loc: np.ndarray,
                     logits_rows: list[np.ndarray]) -> list[PromptLogprobsChunk]:
    """Chunks for requests computing prompt positions and asking for prompt logprobs.

    Position p's hidden state predicts token p + 1, so a chunk over positions [start, end)
    yields the logprobs of prompt tokens start + 1 .. min(end, num_prompt - 1).
    """
    num_top = batch.num_prompt_logprobs[rows]
    num_prompt = batch.num_prompt_tokens[rows]
    wanted = np.flatnonzero((num_top != NO_LOGPROBS) & (num_computed < num_prompt))
    chunks = []
    for i in wanted.tolist():
        start = int(num_computed[i])
        end = min(int(seq_lens[i]), int(num_prompt[i]) - 1)
        count = max(end - start, 0)
        logits_rows.append(query_start_loc[i] + np.arange(count))
        targets = batch.token_ids[rows[i], start + 1:start + 1 + count].copy()
        chunks.append(PromptLogprobsChunk(int(handles[i]), targets, int(num_top[i]),
                                          is_last_chunk=bool(seq_lens[i] >= num_prompt[i])))
    return chunks


def dummy_step_batch(num_tokens: int, block_size: int, device: torch.device) -> StepBatch:
    """One request prefilling num_tokens tokens into blocks 1.. (for memory profiling)."""
    positions = np.arange(num_tokens)
    num_blocks = -(-num_tokens // block_size)
    block_table = np.arange(1, num_blocks + 1, dtype=np.int32)[None, :]
    query_start_loc = np.array([0, num_tokens])
    seq_lens = np.array([num_tokens])
    attn = CommonAttentionMetadata(
        num_reqs=1, num_actual_tokens=num_tokens, num_decodes=int(num_tokens == 1),
        max_query_len=num_tokens,
        query_start_loc=torch.from_numpy(query_start_loc).to(device, torch.int32),
        query_start_loc_cpu=query_start_loc,
        seq_lens=torch.from_numpy(seq_lens).to(device, torch.int32), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(positions + block_size).to(device, torch.int64))
    return StepBatch(
        handles=np.zeros(1, np.int32), rows=np.zeros(1, np.int64),
        seq_lens=seq_lens.astype(np.int32),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=torch.from_numpy(positions).to(device), attn=attn,
        sampling_index=np.zeros(1, np.int64), num_draft_tokens=np.zeros(1, np.int64),
        logits_indices=torch.tensor([num_tokens - 1], device=device), prompt_logprobs=[])
