"""The KV cache manager of a hybrid (Mamba2 + attention) engine: prefix caching with state
checkpoints, after vLLM's hybrid KV cache manager in mamba "align" mode.

A cached prefix serves a hybrid request only up to a block boundary where the worker kept
a copy of the recurrent state (state_checkpoint_pool.py): the hit is the longest cached run
of attention blocks, cut back to the last boundary with a checkpoint. Checkpoints are taken
where the next request is likely to resume:
- at the last block boundary of a request's known tokens (its prompt, or on resume after
  preemption every token so far): `align_prefill` ends a prompt chunk exactly there;
- past the prompt, at each boundary its decode reaches, keeping the latest one per request:
  the next chat turn (this prompt + answer + a new message) hits up to there.
"""

from __future__ import annotations

from services.scheduler.core.config import SchedulerConfig
from services.scheduler.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from services.scheduler.core.output import StateCheckpointOps
from services.scheduler.core.request import Request
from services.scheduler.core.state_checkpoint_pool import StateCheckpointPool


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 num_state_checkpoints: int, enable_kv_events: bool = False) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_caching=True,
                         enable_kv_events=enable_kv_events)
        self.checkpoints = StateCheckpointPool(num_state_checkpoints, block_size)
        self._req_to_restore: dict[str, int] = {}   # admitted with a hit, not yet sent

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        blocks, _ = super().get_computed_blocks(request)
        hashes = request.block_hashes
        for num_blocks in range(blocks.num_blocks, 0, -1):
            if self.checkpoints.lookup(hashes[num_blocks - 1]) is not None:
                return KVCacheBlocks(blocks.blocks[:num_blocks]), num_blocks * self.block_size
        return self.empty_kv_cache_blocks, 0

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        result = super().allocate_slots(request, num_new_tokens, new_computed_blocks,
                                        num_new_computed_tokens, delay_cache_blocks)
        if result is not None and new_computed_blocks is not None and new_computed_blocks.blocks:
            slot = self.checkpoints.lookup(
                request.block_hashes[new_computed_blocks.num_blocks - 1])
            assert slot is not None, "a hybrid prefix hit ends at a state checkpoint"
            self._req_to_restore[request.request_id] = slot
        return result

    def align_prefill(self, request: Request, num_computed_tokens: int,
                      num_new_tokens: int) -> int:
        """Ends a prompt chunk that would run past the last block boundary of the request's
        known tokens at that boundary, so a step ends there and saves the state (unless a
        checkpoint of it is kept already). Costs one more step for the tokens after it."""
        block_size = self.block_size
        boundary = request.num_tokens // block_size * block_size
        if (num_computed_tokens < boundary < num_computed_tokens + num_new_tokens
                and not self.checkpoints.contains(
                    request.block_hashes[boundary // block_size - 1])):
            return boundary - num_computed_tokens
        return num_new_tokens

    def trim_drafts(self, request: Request, num_drafts: int) -> int:
        """Keeps a decode's drafts short of the next block boundary, and drops them in the
        step whose own token ends there: a step with drafts never ends at a boundary, so a
        checkpoint is saved only from a step without drafts, whose state holds exactly the
        boundary's tokens (rejected drafts would leave it short of them)."""
        next_token = request.num_computed_tokens + 1
        boundary = -(-next_token // self.block_size) * self.block_size
        return max(0, min(num_drafts, boundary - 1 - next_token))

    def plan_state_checkpoints(self, new_reqs: dict[Request, int],
                               running_reqs: dict[Request, int]) -> StateCheckpointOps:
        """The step's restores (new requests with a prefix hit) and saves (rows whose
        scheduled tokens end at a boundary worth keeping), from what the step scheduled
        (before their computed tokens move on)."""
        ops = StateCheckpointOps()
        for request in new_reqs:
            slot = self._req_to_restore.pop(request.request_id, None)
            if slot is not None:
                ops.restore_handles.append(request.handle)
                ops.restore_slots.append(slot)
        block_size = self.block_size
        for scheduled in (new_reqs, running_reqs):
            for request, num_tokens in scheduled.items():
                end = request.num_computed_tokens + num_tokens
                # Only the last boundary of the known tokens, or past them (decodes).
                if end % block_size or end + block_size <= request.num_tokens:
                    continue
                slot = self.checkpoints.take(request, end)
                if slot is not None:
                    ops.save_handles.append(request.handle)
                    ops.save_slots.append(slot)
        return ops

    def free(self, request: Request) -> None:
        super().free(request)
        self.checkpoints.release(request)
        self._req_to_restore.pop(request.request_id, None)

    def reset_prefix_cache(self) -> bool:
        if not super().reset_prefix_cache():
            return False
        self.checkpoints.reset()
        return True


def create_kv_cache_manager(config: SchedulerConfig, num_blocks: int,
                            enable_eviction_records: bool = False) -> KVCacheManager:
    """The engine's KV cache manager: a hybrid one where the worker keeps state checkpoints
    and prefix caching is on."""
    if config.num_state_checkpoints and config.enable_prefix_caching:
        return HybridKVCacheManager(num_blocks, config.block_size, config.max_model_len,
                                    config.num_state_checkpoints, config.enable_kv_events)
    return KVCacheManager(num_blocks, config.block_size, config.max_model_len,
                          config.enable_prefix_caching, config.enable_kv_events,
                          enable_eviction_records)
