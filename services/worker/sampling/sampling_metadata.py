"""The sampling parameters of one step's sampling rows as batch tensors (vLLM's SamplingMetadata).

Built from the persistent batch's columns with a few numpy gathers; everything a row does not
use stays None, so the sampler skips the work (an all-greedy batch is an argmax).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from services.worker.runner.input_batch import NO_LOGPROBS, InputBatch, offsets_in_runs
from services.worker.sampling.structured_outputs import GrammarBitmask

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's threshold)


@dataclass
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor | None = None   # fp32 [N]; greedy rows hold 1.0
    is_greedy: torch.Tensor | None = None     # bool [N]
    top_k: torch.Tensor | None = None         # int64 [N]; 0 = off
    top_p: torch.Tensor | None = None         # fp32 [N]; +inf = off
    min_p: torch.Tensor | None = None         # fp32 [N]; 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # batch row -> gen
    # Logits processing (before greedy argmax too), None when no row uses it.
    repetition_penalty: torch.Tensor | None = None  # fp32 [N]
    presence_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    prompt_token_ids: torch.Tensor | None = None    # int64 [N, max_prompt], padded with vocab
    output_token_ids: torch.Tensor | None = None    # int64 [N, max_output], padded with vocab
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, vals
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, ids (min_tokens stops)
    grammar_bitmask: GrammarBitmask | None = None   # structured outputs' constrained rows
    # Logprobs: batch rows that asked, and the most alternatives any of them asked for.
    logprob_rows: torch.Tensor | None = None  # int64 [M]
    max_num_logprobs: int = 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty is not None

    @property
    def unreported_rows(self) -> list[int]:
        """Rows whose grammar cannot go on, or is still compiling: their token is not
        reported."""
        mask = self.grammar_bitmask
        return mask.failed + mask.deferred if mask is not None else []

    @property
    def deferred_rows(self) -> list[int]:
        """Rows whose grammar is still compiling: they sample again next step."""
        return self.grammar_bitmask.deferred if self.grammar_bitmask is not None else []

    @property
    def rejections(self) -> dict[int, str]:
        """Of those, the rows whose own grammar is at fault, and why."""
        return self.grammar_bitmask.rejections if self.grammar_bitmask is not None else {}

    @property
    def needs_processing(self) -> bool:
        return self.has_penalties or self.logit_bias is not None or self.banned is not None


def build_sampling_metadata(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    """Metadata for the requests in `rows` (their sampling order), which sample this step."""
    def col(values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(values).to(device)

    temperature = batch.temperature[rows]
    is_greedy = temperature < SAMPLING_EPS
    md = SamplingMetadata(num_rows=len(rows), all_greedy=bool(is_greedy.all()),
                          all_random=not is_greedy.any())
    if not md.all_greedy:
        md.temperature = col(np.where(is_greedy, np.float32(1.0), temperature))
        md.is_greedy = col(is_greedy)
        top_k = batch.top_k[rows]
        if top_k.any():
            md.top_k = col(top_k.astype(np.int64))
        top_p = batch.top_p[rows]
        if (top_p < 1.0).any():
            md.top_p = col(np.where(top_p < 1.0, top_p, np.float32(np.inf)))
        min_p = batch.min_p[rows]
        if min_p.any():
            md.min_p = col(min_p)
        md.generators = {i: batch.generators[r] for i, r in enumerate(rows.tolist())
                         if r in batch.generators}
    _add_penalties(md, batch, rows, vocab_size, col)
    _add_sparse_masks(md, batch, rows, device)
    if batch.structured_outputs is not None:
        md.grammar_bitmask = batch.structured_outputs.fill_bitmask(rows, batch.token_ids,
                                                                   batch.num_tokens)
        for i in md.deferred_rows:
            # NOTE: a seeded row samples again next step: its own generator must not move.
            md.generators.pop(i, None)
    num_logprobs = batch.num_logprobs[rows]
    wants = np.flatnonzero(num_logprobs != NO_LOGPROBS)
    if len(wants):
        md.logprob_rows = col(wants)
        md.max_num_logprobs = int(num_logprobs[wants].max())
    return md


def _add_penalties(md: SamplingMetadata, batch: InputBatch, rows: np.ndarray, vocab_size: int,
                   col) -> None:
    repetition = batch.repetition_penalty[rows]
    presence = batch.presence_penalty[rows]
    frequency = batch.frequency_penalty[rows]
    if (repetition == 1.0).all() and not presence.any() and not frequency.any():
        return
    md.repetition_penalty = col(repetition)
    md.presence_penalty = col(presence)
    md.frequency_penalty = col(frequency)
    num_prompt = batch.num_prompt_tokens[rows]
    # A row verifying drafts has a position per draft: each one's output so far includes
    # the drafts before it (they lie right after the row's known tokens), as it would have
    # one token at a time.
    num_output = batch.num_tokens[rows] - num_prompt + offsets_in_runs(rows)
    prompt = np.full((len(rows), max(int(num_prompt.max()), 1)), vocab_size, dtype=np.int64)
    output = np.full((len(rows), max(int(num_output.max()), 1)), vocab_size, dtype=np.int64)
    for i, (row, p, o) in enumerate(zip(rows.tolist(), num_prompt.tolist(), num_output.tolist())):
        prompt[i, :p] = batch.token_ids[row, :p]
        output[i, :o] = batch.token_ids[row, p:p + o]
    md.prompt_token_ids = col(prompt)
    md.output_token_ids = col(output)


def _add_sparse_masks(md: SamplingMetadata, batch: InputBatch, rows: np.ndarray,
                      device: torch.device) -> None:
    """logit_bias entries, and the stop tokens of rows still short of min_tokens."""
    bias_rows, bias_ids, bias_values, ban_rows, ban_ids = [], [], [], [], []
    if batch.logit_bias or batch.min_tokens_stop_ids:
        for i, row in enumerate(rows.tolist()):
            if row in batch.logit_bias:
                ids, values = batch.logit_bias[row]
                bias_rows.append(np.full(len(ids), i))
                bias_ids.append(ids)
                bias_values.append(values)
            stop_ids = batch.min_tokens_stop_ids.get(row)
            num_output = batch.num_tokens[row] - batch.num_prompt_tokens[row]
            if stop_ids is not None and num_output < batch.min_tokens[row]:
                ban_rows.append(np.full(len(stop_ids), i))
                ban_ids.append(stop_ids)
    if bias_rows:
        md.logit_bias = (torch.from_numpy(np.concatenate(bias_rows)).to(device),
                         torch.from_numpy(np.concatenate(bias_ids)).to(device),
                         torch.from_numpy(np.concatenate(bias_values)).to(device))
    if ban_rows:
        md.banned = (torch.from_numpy(np.concatenate(ban_rows)).to(device),
                     torch.from_numpy(np.concatenate(ban_ids)).to(device))
