"""A hybrid model's recurrent states in the worker (docs/hybrid_models.md): one slot per
persistent-batch row, allocated at start-up for max_num_seqs rows, beside the paged KV cache,
and checkpoint slots: copies of a state at a block boundary, for prefix caching.

A request's slot is its row. Each step names, per scheduled row, how many of its tokens the
state has seen (the row's computed tokens): 0 starts it from zero whatever the slot holds (a
new request, or one preempted and prefilled again: preemption is by recompute), more continues
it (a prefill chunk, a decode). A state holds no history, so a row may only continue from
exactly the tokens its state took. A new request with a prefix-cache hit first gets its state
copied from the checkpoint the scheduler names (hybrid_kv_cache_manager.py), which must hold
exactly that many tokens; a step's saves copy rows into checkpoints after its forward pass.
A row verifying drafts (n-gram or suffix speculation) keeps its state after each of its step's
tokens (mamba2.py: TokenStates); once the verifier has counted the accepted drafts, the row's
slot takes the state after its last accepted token (vLLM's way for Mamba layers: no second
pass). Anything else (a hit without its checkpoint, a position recomputed) is refused with an
error, never computed from the wrong state. What would ask for that is refused at start-up
(check_hybrid_config), and grammar rows wait for their compile here instead of being deferred.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import unpack_int32
from services.worker.models.hybrid_lm import HybridForCausalLM
from services.worker.kv.kv_cache import RecurrentStateSize
from services.worker.models.config import ModelConfig, UnsupportedModelError
from services.worker.models.mamba2 import Mamba2State, StateBatch
from services.worker.runner.config import RunnerConfig
from services.worker.runner.input_batch import InputBatch, InputBatchError
from services.worker.runner.step_batch import StepBatch
from services.worker.runner.step_hooks import StepHooks

# NOTE: fp32 keeps a long decode's state from drifting (vLLM's mamba_ssm_cache_dtype).
SSM_STATE_DTYPE = torch.float32
# Proposers that draft from the request's tokens alone; a drafter with layers of its own (a
# draft model, EAGLE-3, MTP) would need its own recurrent state and rollback.
MODEL_FREE_PROPOSERS = ("ngram", "suffix")


def check_hybrid_config(config: RunnerConfig, model_config: ModelConfig) -> None:
    """Refuses what a hybrid engine cannot do yet: each needs a state it does not keep."""
    if not model_config.is_hybrid:
        return
    spec = config.speculative_config
    refused = {f"--speculative-config method {spec.method if spec else ''!r} (only "
               f"{' and '.join(MODEL_FREE_PROPOSERS)} drafts are verified on a hybrid)":
               spec is not None and spec.method not in MODEL_FREE_PROPOSERS,
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
    num_checkpoints = config.num_state_checkpoints
    return HybridStates(get_model, config.max_num_seqs,
                        config.max_num_seqs if num_checkpoints is None else num_checkpoints)


class HybridStates(StepHooks):
    def __init__(self, get_model: Callable[[], object], max_num_seqs: int,
                 num_checkpoints: int):
        self._get_model = get_model
        model = self.model
        self.states: list[Mamba2State] = model.allocate_states(max_num_seqs, SSM_STATE_DTYPE)
        # Per row: the tokens its state has taken, to refuse a step continuing from others.
        self.num_state_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_checkpoints = num_checkpoints
        self.checkpoints: list[Mamba2State] = model.allocate_states(num_checkpoints,
                                                                    SSM_STATE_DTYPE)
        # Per checkpoint: the tokens of the state it holds (-1: none, or a save that failed).
        self.num_checkpoint_tokens = np.full(num_checkpoints, -1, dtype=np.int64)
        self._bound: StepBatch | None = None   # the last forward pass's batch (its saves)
        self._verify_seqs = np.zeros(0, dtype=np.int64)   # its rows verifying drafts
        # NOTE: logged with the KV cache's size (log_kv_cache_size), which it bounds too.
        self.size = RecurrentStateSize(
            max_num_seqs, num_checkpoints,
            model.mamba_shape.state_bytes(model.dtype, SSM_STATE_DTYPE) * len(self.states))

    @property
    def model(self) -> HybridForCausalLM:
        model = self._get_model()
        assert isinstance(model, HybridForCausalLM)
        return model

    def add_requests(self, input_batch: InputBatch, step: wire_pb.StepInput) -> None:
        """New rows with a prefix-cache hit start from the checkpoint the step names."""
        if not step.state_restore_handles:
            return
        rows = input_batch.rows_of(unpack_int32(step.state_restore_handles))
        slots = unpack_int32(step.state_restore_slots).astype(np.int64)
        num_tokens = input_batch.num_computed_tokens[rows].astype(np.int64)
        wrong = np.flatnonzero(self.num_checkpoint_tokens[slots] != num_tokens)
        if len(wrong):
            i = int(wrong[0])
            raise InputBatchError(
                f"hybrid model: a request resumes at token {int(num_tokens[i])} from state "
                f"checkpoint {int(slots[i])}, which holds "
                f"{int(self.num_checkpoint_tokens[slots[i]])} tokens")
        copy_states(self.checkpoints, slots, self.states, rows)
        self.num_state_tokens[rows] = num_tokens

    def after_sampling(self, input_batch: InputBatch, handles: np.ndarray, rows: np.ndarray,
                       out: wire_pb.StepOutput) -> None:
        """Rolls each verifying row's slot back to the state after its last accepted token
        (the verifier has moved its computed tokens back over the rejected drafts)."""
        batch, seqs = self._bound, self._verify_seqs
        if batch is None or not len(seqs):
            return
        verify_rows = batch.rows[seqs]
        num_computed = input_batch.num_computed_tokens[verify_rows].astype(np.int64)
        rolled = np.flatnonzero(num_computed < self.num_state_tokens[verify_rows])
        if len(rolled):
            query_lens = np.diff(batch.attn.query_start_loc_cpu)[seqs[rolled]]
            # The state after the query's (kept)-th token is entry kept - 1.
            positions = num_computed[rolled] - (batch.seq_lens[seqs[rolled]] - query_lens) - 1
            copy_token_states(self.states, rolled, positions, verify_rows[rolled])
            self.num_state_tokens[verify_rows[rolled]] = num_computed[rolled]
        for state in self.states:
            state.token_states = None   # NOTE: (1 + drafts) states per row: not kept past here

    def before_forward(self, step: wire_pb.StepInput) -> None:
        # NOTE: a save that never runs (the step fails) must not leave an older state named.
        if step.state_save_slots:
            self.num_checkpoint_tokens[unpack_int32(step.state_save_slots)] = -1

    def finish_step(self, step: wire_pb.StepInput, out: wire_pb.StepOutput,
                    ran_forward: bool) -> None:
        """Copies the rows the step names into their checkpoints, in order (a later save
        into a slot wins); a handle that did not run leaves its slot empty."""
        batch, self._bound = self._bound, None
        if not step.state_save_handles or not ran_forward or batch is None:
            return
        handle_to_row = dict(zip(batch.handles.tolist(), batch.rows.tolist()))
        saves = {slot: handle_to_row[handle] for handle, slot in zip(
            unpack_int32(step.state_save_handles).tolist(),
            unpack_int32(step.state_save_slots).tolist()) if handle in handle_to_row}
        if saves:
            slots, rows = np.fromiter(saves, np.int64), np.fromiter(saves.values(), np.int64)
            copy_states(self.states, rows, self.checkpoints, slots)
            self.num_checkpoint_tokens[slots] = self.num_state_tokens[rows]

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
        self._bound = batch
        self._verify_seqs = batch.sampling_index[batch.num_draft_tokens > 0].astype(np.int64)
        self.model.set_step_states(self.states, StateBatch(
            tuple(batch.rows.tolist()), tuple(batch.attn.query_start_loc_cpu.tolist()),
            tuple(num_computed.tolist()), tuple(self._verify_seqs.tolist())))


def copy_token_states(states: list[Mamba2State], seqs: np.ndarray, positions: np.ndarray,
                      dst_slots: np.ndarray) -> None:
    """Every Mamba layer's state after token `positions[i]` of verifying sequence `seqs[i]`
    (indices into the pass's TokenStates) into its slot `dst_slots[i]`."""
    device = states[0].conv_states.device if states else None
    seq_index, position_index, dst_index = (torch.from_numpy(a).to(device)
                                            for a in (seqs, positions, dst_slots))
    for state in states:
        kept = state.token_states
        assert kept is not None, "the forward pass kept no per-token states"
        state.conv_states[dst_index] = kept.conv_states[seq_index, position_index]
        state.ssm_states[dst_index] = kept.ssm_states[seq_index, position_index]


def copy_states(src: list[Mamba2State], src_slots: np.ndarray, dst: list[Mamba2State],
                dst_slots: np.ndarray) -> None:
    """Every Mamba layer's conv and SSM states of `src_slots` into `dst_slots`."""
    device = src[0].conv_states.device if src else None
    src_index = torch.from_numpy(src_slots).to(device)
    dst_index = torch.from_numpy(dst_slots).to(device)
    for source, target in zip(src, dst):
        target.conv_states[dst_index] = source.conv_states[src_index]
        target.ssm_states[dst_index] = source.ssm_states[src_index]
