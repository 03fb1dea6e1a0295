"""Packs a step's results into the wire's column-wise StepOutput."""

from __future__ import annotations

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import (
    pack_float32,
    pack_int32,
    pack_strings,
    unpack_int32,
    unpack_strings,
)
from services.worker.runner.step_batch import StepBatch
from services.worker.sampling.sampler import SamplerOutput, gather_logprobs


def add_rejections(out: wire_pb.StepOutput, rejections: dict[int, str]) -> None:
    """Adds requests refused outside sampling (handle -> why) to the output's rejected ones."""
    if not rejections:
        return
    out.rejected_handles = pack_int32(np.concatenate(
        [unpack_int32(out.rejected_handles), np.fromiter(rejections, np.int32)]))
    out.rejected_reasons = pack_strings(unpack_strings(out.rejected_reasons)
                                        + list(rejections.values()))


def build_step_output(step: int, batch: StepBatch, sampling_handles: np.ndarray,
                      sampled: np.ndarray, sampler_output: SamplerOutput,
                      logprob_rows: torch.Tensor | None,
                      prompt_logits: torch.Tensor | None,
                      unreported: list[int],
                      rejections: dict[int, str] | None = None,
                      deferred: list[int] | None = None,
                      emitted: np.ndarray | None = None) -> wire_pb.StepOutput:
    """sampling_handles / sampled: the handle and int32 token of each sampled position (a
    request verifying drafts has several, consecutive); emitted: a mask of the positions
    whose token the verifier kept (None: all); prompt_logits: fp32 rows of the prompt
    logprob chunks, in chunk order (None when no request asked for prompt logprobs);
    unreported: positions whose token is left out (the scheduler fails their request,
    unless it is deferred); rejections: of those, the positions ended for their own input,
    and why (a 400 for the client); deferred: of those, the positions waiting for their
    grammar (the scheduler schedules their last position again)."""
    reported = np.ones(len(sampled), dtype=bool) if emitted is None else emitted.copy()
    reported[unreported] = False
    out = wire_pb.StepOutput(step=step, handles=pack_int32(sampling_handles[reported]),
                          sampled_token_ids=pack_int32(sampled[reported]))
    if deferred:
        out.deferred_handles = pack_int32(sampling_handles[deferred])
    if rejections:
        out.rejected_handles = pack_int32(sampling_handles[list(rejections)])
        out.rejected_reasons = pack_strings(list(rejections.values()))
    if logprob_rows is not None:
        rows = logprob_rows.cpu().numpy()
        keep = reported[rows]
        kept = torch.from_numpy(keep).to(sampler_output.logprobs.device)
        out.logprob_handles = pack_int32(sampling_handles[rows][keep])
        out.logprobs.CopyFrom(logprob_columns(sampled[rows][keep], sampler_output.logprobs[kept],
                                              sampler_output.top_token_ids[kept],
                                              sampler_output.top_logprobs[kept]))
    if batch.prompt_logprobs:
        out.prompt_logprobs.extend(_prompt_logprob_chunks(batch, prompt_logits))
    return out


def logprob_columns(token_ids: np.ndarray, logprobs: torch.Tensor, top_ids: torch.Tensor,
                    top_logprobs: torch.Tensor) -> wire_pb.LogprobColumns:
    return wire_pb.LogprobColumns(
        token_ids=pack_int32(token_ids), logprobs=pack_float32(logprobs.cpu().numpy()),
        num_top=top_ids.shape[1], top_token_ids=pack_int32(top_ids.cpu().numpy()),
        top_logprobs=pack_float32(top_logprobs.cpu().numpy()))


def _prompt_logprob_chunks(batch: StepBatch,
                           prompt_logits: torch.Tensor | None) -> list[wire_pb.PromptLogprobChunk]:
    chunks = []
    row = 0
    for chunk in batch.prompt_logprobs:
        count = len(chunk.target_token_ids)
        columns = wire_pb.LogprobColumns(num_top=chunk.num_top)
        if count:
            logprobs = prompt_logits[row:row + count].log_softmax(dim=-1)
            targets = torch.from_numpy(chunk.target_token_ids.astype(np.int64))
            columns = logprob_columns(chunk.target_token_ids,
                                      *gather_logprobs(logprobs, targets.to(logprobs.device),
                                                       chunk.num_top))
        chunks.append(wire_pb.PromptLogprobChunk(handle=chunk.handle, columns=columns,
                                              is_last_chunk=chunk.is_last_chunk))
        row += count
    return chunks
