"""A hybrid model's recurrent states in the worker (v0, docs/hybrid_models.md): one slot per
persistent-batch row, allocated at start-up for max_num_seqs rows, beside the paged KV cache.

A request's slot is its row. Each step names, per scheduled row, how many of its tokens the
state has seen (the row's computed tokens): 0 starts it from zero whatever the slot holds (a
new request, or one preempted and prefilled again: preemption is by recompute), more continues
it (a prefill chunk, a decode). A state holds no history, so a row may only continue from
exactly the tokens its state took; anything else (a prefix-cache hit, rejected drafts, a
position recomputed) is refused with an error, never computed from the wrong state. What would
ask for that is off or refused at start-up (check_hybrid_config; the scheduler turns prefix
caching off), and grammar rows wait for their compile here instead of being deferred.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import structlog
import torch

from services.worker.models.bamba import BambaForCausalLM
from services.worker.models.config import ModelConfig, UnsupportedModelError
from services.worker.models.mamba2 import Mamba2State, StateBatch
from services.worker.runner.config import RunnerConfig
from services.worker.runner.input_batch import InputBatch, InputBatchError
from services.worker.runner.step_batch import StepBatch
from services.worker.runner.step_hooks import StepHooks

log = structlog.get_logger(__name__)

# NOTE: fp32 keeps a long decode's state from drifting (vLLM's mamba_ssm_cache_dtype).
SSM_STATE_DTYPE = torch.float32


def check_hybrid_config(config: RunnerConfig, model_config: ModelConfig) -> None:
    """Refuses what a hybrid engine cannot do yet: each needs a state it does not keep."""
    if not model_config.is_hybrid:
        return
    refused = {"--speculative-config (rejected drafts would stay in the state)":
               config.speculative_config is not None,
               "--enable-lora": config.enable_lora,
               "--tensor-parallel-size > 1": config.tensor_parallel_size > 1,
               "--quantization int8": config.quantization != "none",
               "--batch-invariant": config.batch_invariant}
    named = [flag for flag, is_set in refused.items() if is_set]
    if named:
        raise UnsupportedModelError(f"a hybrid (Mamba2 + attention) model does not run with "
                                    f"{', '.join(named)} yet (docs/hybrid_models.md)")


def enable_hybrid_states(get_model: Callable[[], object], config: RunnerConfig,
                         model_config: ModelConfig) -> HybridStates | None:
    """The state slots of a hybrid model; None for any other. `get_model`: the model serving
    now (a weight update or sleep mode swaps it; the slots stay)."""
    if not model_config.is_hybrid:
        return None
    return HybridStates(get_model, config.max_num_seqs)


class HybridStates(StepHooks):
    def __init__(self, get_model: Callable[[], object], max_num_seqs: int):
        self._get_model = get_model
        model = self.model
        self.states: list[Mamba2State] = model.allocate_states(max_num_seqs, SSM_STATE_DTYPE)
        # Per row: the tokens its state has taken, to refuse a step continuing from others.
        self.num_state_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        shape = model.config.mamba
        log.info("recurrent state slots allocated", slots=max_num_seqs,
                 mamba_layers=len(self.states),
                 bytes_per_seq=shape.state_bytes(model.dtype, SSM_STATE_DTYPE) * len(self.states),
                 state_bytes=sum(s.conv_states.nbytes + s.ssm_states.nbytes
                                 for s in self.states))

    @property
    def model(self) -> BambaForCausalLM:
        model = self._get_model()
        assert isinstance(model, BambaForCausalLM)
        return model

    def prepare_forward(self, batch: StepBatch, input_batch: InputBatch) -> None:
        if input_batch.structured_outputs is not None:
            # NOTE: a deferred row recomputes its last position, which its state already took.
            input_batch.structured_outputs.wait_compiled()
        self.bind(batch)

    def bind(self, batch: StepBatch) -> None:
        """Names the batch's rows as the slots the next forward pass continues."""
        query_lens = np.diff(batch.attn.query_start_loc_cpu)
        num_computed = batch.seq_lens.astype(np.int64) - query_lens
        seen = self.num_state_tokens[batch.rows]
        wrong = np.flatnonzero((num_computed != 0) & (num_computed != seen))
        if len(wrong):
            i = int(wrong[0])
            raise InputBatchError(
                f"hybrid model: request handle {int(batch.handles[i])} continues from token "
                f"{int(num_computed[i])} but its recurrent state holds {int(seen[i])} tokens "
                f"(no state is kept for other positions)")
        self.num_state_tokens[batch.rows] = batch.seq_lens
        self.model.set_step_states(self.states, StateBatch(
            tuple(batch.rows.tolist()), tuple(batch.attn.query_start_loc_cpu.tolist()),
            tuple(num_computed.tolist())))
