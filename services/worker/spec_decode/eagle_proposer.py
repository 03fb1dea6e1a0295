"""Drafting from the target's hidden states (vLLM's EagleProposer, for its "eagle3" and "mtp"
methods): a one-layer head drafts a chain of tokens for a fraction of a target forward pass.
The head is an EAGLE-3 head, a checkpoint of its own (eagle3_head.py), or the MTP module
shipped in the target's checkpoint (mtp_head.py); each reads the target's hidden states of
the step (models/llama.py keeps the layers' it names) and runs as follows.

The head's position p runs token p + 1 with the target's hidden state of position p (which
predicted it), so it predicts token p + 2. Per step, after the target sampled:
1. Catch-up: one head pass over every position of the step the target keeps (its accepted
   tokens; prompt chunks too, which sample nothing) whose next token is known, with the
   target's hidden states of those positions. Its KV then mirrors the target's: no
   bookkeeping of its own, and a rejected draft's positions are run again next step with
   the target's states. A row's last position (its newest token's predecessor) yields the
   first draft.
2. k - 1 one-token passes, each running the last draft with the head's own state (EAGLE-3:
   pre-norm, MTP: normed, as vLLM) in place of the target's, yielding the next draft.

The head's KV is a paged cache of its one layer indexed by the target's block ids plus a
few scratch blocks per row, as a draft model's (draft_input_batch.py); the catch-up is built
by prepare_step_batch over the row tokens shifted by one (DraftInputBatch.begin(shift=1)),
so a draft lands right after the row's known tokens, where the verifier reads it. The
chained passes are built at once after it (chain_passes.py) and feed each pass's argmax to
the next on the device: the drafts reach the host once, at the end (12b measured the
generic preparation and a host sync per pass at twice a pass's arithmetic). Positions
the target skipped (a prefix-cache hit) keep whatever head KV their blocks hold, as in
vLLM: that costs acceptance, never correctness (the verifier decides every token).

NOTE (limits): one rank (the kept states are rank 0's), and no CUDA graphs (a replayed graph
would not refresh the kept states): both refused at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
import structlog
import torch

from services.common.model_files import resolve_model
from services.worker.attention.backend import KVCache
from services.worker.models.llama import LlamaForCausalLM
from services.worker.models.weights import WeightSource
from services.worker.runner.config import RunnerConfig, RunnerInfo
from services.worker.runner.input_batch import InputBatch, concat_ranges
from services.worker.runner.model_loader import attention_backend, kv_cache_spec
from services.worker.runner.step_batch import StepBatch
from services.worker.spec_decode.chain_passes import chain_passes
from services.worker.spec_decode.draft_input_batch import DraftInputBatch
from services.worker.spec_decode.draft_model_proposer import draft_model_config
from services.worker.spec_decode.eagle3_head import Eagle3Head
from services.worker.spec_decode.mtp_head import MTPHead
from services.worker.spec_decode.proposer import Proposer

log = structlog.get_logger(__name__)


class DraftHead(Protocol):
    """What the proposer runs: Eagle3Head or MTPHead."""
    # The target layers whose input it reads (num_hidden_layers: the last one's output).
    aux_layer_ids: tuple[int, ...]

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None: ...

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's kept states [T, n * target hidden] as the head's input [T, H]."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed: the logits' input, the next pass's hidden input) [T, H] of one pass."""

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The target ids of the argmax per row."""


class EagleProposer(Proposer):
    def __init__(self, config: RunnerConfig, device: torch.device, info: RunnerInfo,
                 target_model: Callable[[], LlamaForCausalLM]) -> None:
        """target_model: the model the runner serves now (a wake-up or a weight update
        swaps it), whose kept hidden states the head reads."""
        spec = config.speculative_config
        assert spec is not None
        if config.tensor_parallel_size > 1:
            raise ValueError(f"{spec.method} runs with one rank: drop --tensor-parallel-size")
        if device.type == "cuda" and config.enable_cuda_graphs:
            raise ValueError(f"{spec.method} does not run under CUDA graphs yet (a replayed "
                             f"graph does not keep the target's hidden states): serve it on "
                             f"CPU")
        head_dir = (config.model_dir if spec.model is None
                    else resolve_model(spec.model).hf_dir)
        head_runner_config = replace(config, model_dir=head_dir, speculative_config=None)
        head_config = draft_model_config(config)
        self.target_model = target_model
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.max_model_len = info.max_model_len
        self.device = device
        self.attn = attention_backend(head_runner_config, head_config, device)
        weights = WeightSource(head_dir, config.torch_dtype, device)
        self.head: DraftHead
        if spec.method == "mtp":
            self.head = MTPHead(head_dir, weights, self.attn, info.max_model_len,
                                target_model().config, target_model)
        else:
            self.head = Eagle3Head(head_dir, weights, self.attn, info.max_model_len,
                                   target_model().config,
                                   lambda ids: self.target_model().embed_input_ids(ids))
        self.draft_batch, kv_caches = DraftInputBatch.with_kv_caches(
            config, info, kv_cache_spec(head_runner_config, head_config),
            self.num_speculative_tokens, device)
        self.head.bind_kv_caches(kv_caches)
        self._step: StepBatch | None = None
        log.info("draft head ready", method=spec.method, head=head_dir.name,
                 aux_layers=self.head.aux_layer_ids,
                 num_speculative_tokens=self.num_speculative_tokens)

    def prepare_forward(self, step: StepBatch) -> None:
        self._step = step
        # NOTE: set every step: a wake-up or weight update serves a new model object.
        self.target_model().aux_hidden_state_layers = self.head.aux_layer_ids

    def propose(self, batch: InputBatch, rows: np.ndarray) -> np.ndarray:
        num_drafts = np.clip(self.max_model_len - batch.num_tokens[rows], 0,
                             self.num_speculative_tokens).astype(np.int32)
        batch.num_draft_tokens[rows] = 0
        step, self._step = self._step, None
        assert step is not None, "propose without the step's forward pass"
        caught_up = self._catch_up(batch, step)
        if caught_up is None:
            return np.zeros(len(rows), dtype=np.int32)
        passes, normed, carry = caught_up
        # NOTE: a decode whose sample waits for its grammar kept no position: no drafts yet.
        num_drafts[~np.isin(rows, passes.rows)] = 0
        # Most drafts first: each chained pass runs a prefix of the rows.
        order = np.argsort(-num_drafts, kind="stable")
        order = order[num_drafts[order] > 0]
        if len(order):
            last_of_row = np.zeros(batch.max_num_reqs, dtype=np.int64)
            last_of_row[passes.rows] = passes.attn.query_start_loc_cpu[1:] - 1
            index = self._tensor(last_of_row[rows[order]])
            self._draft_chain(rows[order], num_drafts[order], normed[index], carry[index])
        batch.num_draft_tokens[rows] = num_drafts
        return num_drafts

    def _catch_up(self, batch: InputBatch, step: StepBatch
                  ) -> tuple[StepBatch, torch.Tensor, torch.Tensor] | None:
        """Runs the head over the step's kept positions whose next token is known: the
        pass, its normed and carried states (None: no such position)."""
        draft_batch = self.draft_batch
        query_start = step.attn.query_start_loc_cpu
        first = step.seq_lens - np.diff(query_start)   # each row's first position in the step
        kept = np.minimum(batch.num_computed_tokens[step.rows], batch.num_tokens[step.rows] - 1)
        draft_batch.begin(batch, step.rows, shift=1)
        draft_batch.num_computed_tokens[step.rows] = first
        passes = draft_batch.prepare(step.rows, kept - first, self.device)
        if passes is None:
            return None
        # Row -> where its positions start in the target's step, then in this pass.
        target_start = np.zeros(batch.max_num_reqs, dtype=np.int64)
        target_start[step.rows] = query_start[:-1]
        hidden_rows = concat_ranges(target_start[passes.rows],
                                    np.diff(passes.attn.query_start_loc_cpu))
        aux = self.target_model().aux_hidden_states
        assert aux is not None and len(aux) == step.num_tokens
        hidden = self.head.combine_hidden_states(aux[self._tensor(hidden_rows)])
        normed, carry = self.head.forward(passes.input_ids, passes.positions, hidden,
                                          self.attn.build_metadata(passes.attn))
        draft_batch.num_computed_tokens[passes.rows] = passes.seq_lens
        return passes, normed, carry

    def _draft_chain(self, rows: np.ndarray, num_drafts: np.ndarray, normed: torch.Tensor,
                     carry: torch.Tensor) -> None:
        """Drafts num_drafts tokens (non-increasing) after each of `rows` from the catch-up's
        states at their last positions: the first from those, each next from a one-token
        pass running the last draft with its carried state."""
        draft_batch, head = self.draft_batch, self.head
        tokens = head.greedy_tokens(normed)
        drafts = tokens.new_zeros(len(rows), int(num_drafts[0]))
        drafts[:, 0] = tokens
        passes = (chain_passes(draft_batch, rows, num_drafts - 1, self.device)
                  if num_drafts[0] > 1 else [])
        for j, chained in enumerate(passes, start=1):
            n = chained.num_rows
            normed, carry = head.forward(tokens[:n], chained.positions, carry[:n],
                                         self.attn.build_metadata(chained.attn))
            tokens = drafts[:n, j] = head.greedy_tokens(normed)
        drafts_cpu = drafts.cpu().numpy()   # the proposal's one host sync
        for j in range(int(num_drafts[0])):
            drafting = num_drafts > j
            draft_batch.append(rows[drafting], drafts_cpu[drafting, j])
        draft_batch.num_computed_tokens[rows] += num_drafts - 1

    def _tensor(self, indices: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.asarray(indices, dtype=np.int64)).to(self.device)
