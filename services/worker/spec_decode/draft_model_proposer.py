"""A draft model (vLLM's "draft_model" method): a small model with the target's tokenizer,
run by the same worker, proposes each draft with one greedy forward pass.

The draft is built by the target's own loader (model_loader: same model classes, device,
dtype, quantization, attention backend, KV cache dtype; whole, on rank 0, under tensor
parallelism) and keeps its KV in a paged cache of its own shape indexed by the target's
block ids (draft_input_batch.py). Per proposal, for the rows that may speculate: one pass
runs each row's tokens the draft has not seen (the accepted drafts and the bonus token, or
the whole context of a new row, chunked by the step token budget), whose last logits give
the first draft; then one-token passes give the others. Every pass is a varlen batch from
prepare_step_batch over all pending rows.

NOTE (memory): the draft's KV comes out of the target's KV budget: the runner sizes one
block count for both caches (draft_kv_bytes_per_block), as they share block ids. The
draft's weights and a few scratch blocks per row come on top of it; on an accelerator its
weights are not in the profiled peak either (they load after it).

NOTE (cost): k forward passes of the draft per step (the first carries the catch-up), each
ending in a host sync for the argmax, since the next pass reads its tokens from numpy. No
CUDA graphs yet; an EAGLE-3 head or MTP layer (eagle_proposer.py) drafts from the target's
hidden states with one layer instead of a whole model.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import structlog
import torch

from services.common.model_files import resolve_model
from services.worker.models.config import ModelConfig
from services.worker.models.weights import WeightSource
from services.worker.runner.config import RunnerConfig, RunnerInfo
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.model_loader import attention_backend, kv_cache_spec, load_model
from services.worker.spec_decode.draft_input_batch import DraftInputBatch
from services.worker.spec_decode.mtp_head import mtp_layer_config
from services.worker.spec_decode.proposer import Proposer

log = structlog.get_logger(__name__)

DRAFT_KV_METHODS = ("draft_model", "eagle3", "mtp")   # the methods drafting on their own KV


class DraftModelError(ValueError):
    """A draft model that cannot propose for this target."""


class DraftModelProposer(Proposer):
    def __init__(self, config: RunnerConfig, device: torch.device, info: RunnerInfo) -> None:
        """config: the target's (the draft runs alike); info: the target's vocabulary,
        context and number of KV blocks."""
        spec = config.speculative_config
        assert spec is not None and spec.model is not None
        model_dir = resolve_model(spec.model).hf_dir
        model_config = ModelConfig.from_hf_dir(model_dir)
        _check_compatible(model_config, info, spec.model)
        draft_config = replace(config, model_dir=model_dir, speculative_config=None,
                               tensor_parallel_size=1)
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = info.max_model_len
        self.token_budget = config.max_num_batched_tokens
        self.device = device
        self.attn = attention_backend(draft_config, model_config, device)
        self.model = load_model(draft_config, model_config,
                                WeightSource(model_dir, config.torch_dtype, device), self.attn,
                                info.max_model_len)
        kv_spec = kv_cache_spec(draft_config, model_config)
        self.draft_batch, kv_caches = DraftInputBatch.with_kv_caches(
            config, info, kv_spec, self.num_speculative_tokens, device)
        self.model.bind_kv_caches(kv_caches)
        log.info("draft model ready", draft=model_dir.name,
                 num_speculative_tokens=self.num_speculative_tokens)

    def add_requests(self, rows: list[int]) -> None:
        self.draft_batch.forget(rows)

    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        num_drafts = np.clip(self.max_model_len - batch.num_tokens[rows], 0,
                             self.num_speculative_tokens).astype(np.int32)
        batch.num_draft_tokens[rows] = 0
        drafting = rows[num_drafts > 0]
        if not len(drafting):
            return num_drafts
        goal = np.zeros(batch.max_num_reqs, dtype=np.int64)
        goal[drafting] = batch.num_tokens[drafting] + num_drafts[num_drafts > 0]
        draft_batch = self.draft_batch
        draft_batch.begin(batch, drafting)
        pending = drafting
        while len(pending):
            self._run_pass(pending)
            pending = pending[draft_batch.num_tokens[pending] < goal[pending]]
        draft_batch.end(batch, drafting)
        batch.num_draft_tokens[rows] = num_drafts
        return num_drafts

    def _run_pass(self, rows: np.ndarray) -> None:
        """One forward pass over the rows' unseen tokens, within the token budget (a long
        catch-up takes several passes); the rows that reach their last token draft one."""
        draft_batch = self.draft_batch
        wanted = (draft_batch.num_tokens[rows] - draft_batch.num_computed_tokens[rows]
                  ).astype(np.int64)
        before = np.cumsum(wanted) - wanted
        num_scheduled = np.clip(self.token_budget - before, 0, wanted)
        step_batch = draft_batch.prepare(rows, num_scheduled, self.device)
        assert step_batch is not None   # the first row always fits the budget
        hidden = self.model.forward(step_batch.input_ids, step_batch.positions,
                                    self.attn.build_metadata(step_batch.attn))
        draft_batch.num_computed_tokens[step_batch.rows] = step_batch.seq_lens
        logits = self.model.compute_logits(hidden[step_batch.logits_indices])
        draft_batch.append(step_batch.rows[step_batch.sampling_index],
                           logits.argmax(dim=-1).cpu().numpy())


def draft_model_config(config: RunnerConfig) -> ModelConfig:
    """The shape of what drafts with its own KV: the draft model, the EAGLE-3 head, or the
    target checkpoint's MTP layer."""
    spec = config.speculative_config
    assert spec is not None and spec.method in DRAFT_KV_METHODS
    if spec.method == "mtp":
        return mtp_layer_config(ModelConfig.from_hf_dir(config.model_dir))
    assert spec.model is not None
    return ModelConfig.from_hf_dir(resolve_model(spec.model).hf_dir)


def draft_kv_bytes_per_block(config: RunnerConfig) -> int:
    """What the draft's KV (draft_model_config's) takes per block of the target's (0 without
    one), read from its config before anything loads."""
    spec = config.speculative_config
    if spec is None or spec.method not in DRAFT_KV_METHODS:
        return 0
    draft_config = replace(config, speculative_config=None, tensor_parallel_size=1)
    return kv_cache_spec(draft_config, draft_model_config(config)).bytes_per_block


def _check_compatible(draft: ModelConfig, info: RunnerInfo, name: str) -> None:
    if draft.vocab_size != info.vocab_size:
        raise DraftModelError(
            f"draft model {name!r} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{info.vocab_size}: a draft model must share the target's tokenizer")
    if draft.max_context < info.max_model_len:
        raise DraftModelError(
            f"draft model {name!r} serves {draft.max_context} tokens of context, fewer than "
            f"max_model_len={info.max_model_len}: lower --max-model-len")
