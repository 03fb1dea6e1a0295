"""The persistent batch as the draft model sees it: the columns prepare_step_batch reads, so
the draft's passes are built by the same code as the target's steps.

- Token ids are the target batch's own array: a draft lands right after its row's known
  tokens, where the next step and the verifier read it.
- Computed counts are the draft's: how many of the row's tokens its KV holds.
- The block table is the target's (vLLM's approach: the draft's cache is indexed by the same
  block ids, so no second allocator), followed per row by a few scratch blocks of the draft's
  own. The scheduler allocates blocks for what it schedules, so the bonus token and the
  drafts may lie past the row's blocks; their KV goes to scratch and never counts as
  computed: a later proposal recomputes those positions once the row's blocks cover them.

Handles are rows here: the draft steps are addressed by the target batch's row indices.
"""

from __future__ import annotations

import math

import numpy as np
import structlog
import torch

from services.common import wire_pb
from services.common.packing import pack_int32
from services.worker.attention.backend import KVCache
from services.worker.kv.kv_cache import KVCacheSpec, allocate_kv_caches
from services.worker.runner.config import RunnerConfig, RunnerInfo
from services.worker.runner.input_batch import NO_LOGPROBS, InputBatch
from services.worker.runner.step_batch import StepBatch, prepare_step_batch

log = structlog.get_logger(__name__)


class DraftInputBatch:
    def __init__(self, max_num_reqs: int, max_num_blocks_per_req: int, block_size: int,
                 num_scratch_blocks: int, first_scratch_block: int) -> None:
        """Row r's scratch blocks are num_scratch_blocks ids from first_scratch_block +
        r * num_scratch_blocks (past the target's blocks in the draft's cache)."""
        self.block_size = block_size
        self.num_scratch_blocks = num_scratch_blocks
        self.token_ids = np.zeros((0, 0), dtype=np.int32)   # the target's, from `begin`
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)   # known + drafts so far
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req + num_scratch_blocks),
                                    dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # What prepare_step_batch reads besides: the draft verifies nothing, samples no
        # prompt logprobs.
        self.num_draft_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int32)
        self._scratch = (first_scratch_block + np.arange(max_num_reqs * num_scratch_blocks,
                                                         dtype=np.int32)
                         ).reshape(max_num_reqs, num_scratch_blocks)

    @classmethod
    def with_kv_caches(cls, config: RunnerConfig, info: RunnerInfo, kv_spec: KVCacheSpec,
                       num_speculative_tokens: int, device: torch.device
                       ) -> tuple[DraftInputBatch, list[KVCache]]:
        """The batch over a draft cache of the target's blocks plus, per row, scratch for its
        bonus token and drafts (k positions at most, from a block boundary, since the row's
        blocks cover its other tokens); and that cache, allocated."""
        num_scratch_blocks = math.ceil(num_speculative_tokens / config.block_size)
        num_blocks = info.num_blocks + config.max_num_seqs * num_scratch_blocks
        log.info("draft KV cache", num_blocks=num_blocks,
                 kv_cache_gib=round(num_blocks * kv_spec.bytes_per_block / 2**30, 3))
        batch = cls(config.max_num_seqs, math.ceil(info.max_model_len / config.block_size),
                    config.block_size, num_scratch_blocks, first_scratch_block=info.num_blocks)
        return batch, allocate_kv_caches(kv_spec, num_blocks, device)

    def prepare(self, rows: np.ndarray, num_scheduled: np.ndarray,
                device: torch.device) -> StepBatch | None:
        """A draft pass over `num_scheduled` tokens of each row from its computed ones,
        built like a target step (decodes first, then the others, each in order); None when
        it has no tokens."""
        step = wire_pb.StepInput(cached_handles=pack_int32(rows),
                                 num_scheduled_tokens=pack_int32(num_scheduled))
        return prepare_step_batch(step, self, self.block_size, device)

    def rows_of(self, handles: np.ndarray) -> np.ndarray:
        return np.asarray(handles, dtype=np.int64)

    def forget(self, rows: list[int]) -> None:
        """New requests took `rows`: the draft's KV there is not theirs."""
        self.num_computed_tokens[rows] = 0

    def begin(self, batch: InputBatch, rows: np.ndarray, shift: int = 0) -> None:
        """Takes the target's tokens and blocks of `rows` for a proposal. shift=1 (EAGLE)
        sees each row's tokens from its second on: position p holds token p + 1, the token
        the draft runs with the target's hidden state of position p."""
        self.token_ids = batch.token_ids[:, shift:]
        num_tokens = batch.num_tokens[rows] - shift
        self.num_tokens[rows] = num_tokens
        # NOTE: the last known token always runs: its logits propose the first draft.
        self.num_computed_tokens[rows] = np.minimum(self.num_computed_tokens[rows],
                                                    num_tokens - 1)
        num_blocks = batch.num_blocks[rows]
        width = int(num_blocks.max())
        self.block_table[rows, :width] = batch.block_table[rows, :width]
        columns = num_blocks[:, None] + np.arange(self.num_scratch_blocks)
        self.block_table[rows[:, None], columns] = self._scratch[rows]
        self.num_blocks[rows] = num_blocks + self.num_scratch_blocks

    def append(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Each row's next draft, after its tokens."""
        self.token_ids[rows, self.num_tokens[rows]] = token_ids
        self.num_tokens[rows] += 1

    def end(self, batch: InputBatch, rows: np.ndarray) -> None:
        """Counts as computed only known tokens whose KV lies in the row's own blocks: a
        draft's KV is the request's only if the target accepts it, and scratch is reused."""
        self.num_computed_tokens[rows] = np.minimum(
            batch.num_tokens[rows], batch.num_blocks[rows] * self.block_size)
