"""What the model runner asks of speculative decoding: drafts for the requests that just
sampled (reported in the StepOutput), and the requests that arrive and leave."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from services.common import wire_pb
from services.common.packing import pack_int32
from services.worker.models.llama import LlamaForCausalLM
from services.worker.runner.config import RunnerConfig, RunnerInfo
from services.worker.runner.input_batch import InputBatch
from services.worker.runner.step_batch import StepBatch
from services.worker.runner.step_hooks import StepHooks
from services.worker.spec_decode.draft_model_proposer import DraftModelProposer
from services.worker.spec_decode.eagle_proposer import EagleProposer
from services.worker.spec_decode.ngram_proposer import NgramProposer
from services.worker.spec_decode.proposer import Proposer
from services.worker.spec_decode.suffix_proposer import SuffixProposer


class Speculator(StepHooks):
    def __init__(self, config: RunnerConfig, device: torch.device, info: RunnerInfo,
                 target_model: Callable[[], LlamaForCausalLM]) -> None:
        """config: the runner's, with its speculative_config; info: what the runner built
        (the draft model's KV cache follows the target's blocks); target_model: the model
        the runner serves now (EAGLE-3 and MTP draft from its hidden states)."""
        spec = config.speculative_config
        assert spec is not None
        self.proposer: Proposer
        if spec.method == "draft_model":
            self.proposer = DraftModelProposer(config, device, info)
        elif spec.method in ("eagle3", "mtp"):
            self.proposer = EagleProposer(config, device, info, target_model)
        else:
            self.proposer = (SuffixProposer if spec.method == "suffix"
                             else NgramProposer)(spec, info.max_model_len)

    def prepare_forward(self, batch: StepBatch, input_batch: InputBatch) -> None:
        self.proposer.prepare_forward(batch)

    def after_sampling(self, batch: InputBatch, handles: np.ndarray, rows: np.ndarray,
                       out: wire_pb.StepOutput) -> None:
        """Drafts for the next step of the requests that sampled (`handles` at `rows`) and
        may speculate; a request still short of min_tokens bans stop tokens by its output
        count, which drafts would move, so it waits."""
        eligible = batch.can_speculate[rows] & (
            batch.num_tokens[rows] - batch.num_prompt_tokens[rows] >= batch.min_tokens[rows])
        batch.num_draft_tokens[rows] = 0
        num_drafts = self.proposer.propose(batch, rows[eligible])
        if batch.structured_outputs is not None:
            num_drafts = batch.structured_outputs.trim_drafts(
                rows[eligible], num_drafts, batch.token_ids, batch.num_tokens)
            batch.num_draft_tokens[rows[eligible]] = num_drafts
        drafted = num_drafts > 0
        if drafted.any():
            out.draft_handles = pack_int32(handles[eligible][drafted])
            out.num_draft_tokens = pack_int32(num_drafts[drafted])

    def add_requests(self, batch: InputBatch, step: wire_pb.StepInput) -> None:
        """The step's new requests just took rows (new, resumed, or sent again)."""
        if step.new_requests:
            handles = [new.handle for new in step.new_requests]
            self.proposer.add_requests(batch.rows_of(handles).tolist())

    def remove_requests(self, batch: InputBatch, handles: list[int]) -> None:
        """The requests of `handles` finished (or were preempted) and their rows go."""
        rows = [row for handle in handles if (row := batch.handle_to_row.get(handle)) is not None]
        if rows:
            self.proposer.remember(batch, rows)
