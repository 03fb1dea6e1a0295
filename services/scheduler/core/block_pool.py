"""All KV blocks, their ref counts and the prefix cache (hash -> block); vLLM's block_pool.py."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.block_hash import BlockHash
from services.scheduler.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from services.scheduler.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from services.scheduler.core.request import Request


class BlockPool:
    """Owns every block, preallocated once.

    - Block 0 is the null block: reserved, never handed out, freed or cached, so the worker
      may use its slot as padding. `num_blocks` counts it; `num_blocks - 1` are usable.
    - A block is either free (ref_cnt 0, in `free_block_queue`) or referenced by block tables
      (ref_cnt = the number of tables holding it), never both.
    - A full block may carry a hash and sit in `cached_block_hash_to_block`. It keeps the hash
      after it is freed, so a later request can still hit it; the hash is dropped only when the
      block is popped for reuse (eviction), or by `reset_prefix_cache`.
    - With `enable_kv_events`, changes to the cache are queued as events; `take_events` drains.
    - With `enable_eviction_records`, cached blocks popped for reuse are listed (id, hash)
      before the hash is dropped, so the KV connector can copy them out first;
      `take_evicted_blocks` drains.
    """

    def __init__(self, num_blocks: int, enable_caching: bool, enable_kv_events: bool = False,
                 enable_eviction_records: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 blocks (block 0 is the reserved null block)")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks[1:])
        # NOTE: one block per hash. When two requests compute the same block before either
        # cached it, the second copy stays unhashed and is simply freed with its request.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.enable_eviction_records = enable_eviction_records
        self._kv_event_queue: list[KVCacheEvent] = []
        self._evicted_blocks: list[tuple[int, BlockHash]] = []
        self.num_frees = 0
        """Calls of free_blocks that queued a block: the eviction order changed at its back."""

    # ---- allocate / touch / free ------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pops `num_blocks` from the front of the free queue, evicting their cached hashes."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        evicted: list[BlockHash] = []
        for block in blocks:
            assert block.ref_cnt == 0
            block.ref_cnt = 1
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self.enable_eviction_records:
                    self._evicted_blocks.append((block.block_id, block.block_hash))
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
        if evicted and self.enable_kv_events:
            self._kv_event_queue.append(BlockRemoved(evicted))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: one more table holds each block; a free one leaves the free queue."""
        remove = self.free_block_queue.remove
        for block in blocks:
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1

    def refresh(self, prefix: Sequence[KVCacheBlock]) -> None:
        """Moves the free blocks of `prefix` (leading blocks, in order) to the back of the
        eviction order, as if just freed: its first block is evicted last."""
        free = [block for block in prefix if block.ref_cnt == 0]
        remove = self.free_block_queue.remove
        for block in free:
            remove(block)
        self.free_block_queue.append_n(reversed(free))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each block; those left unreferenced join the free queue in
        the given order (the first given is evicted first)."""
        freed = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freed.append(block)
        if freed:
            self.free_block_queue.append_n(freed)
            self.num_frees += 1

    # ---- prefix cache -----------------------------------------------------------------
    def cache_full_blocks(self, request: Request, blocks: Sequence[KVCacheBlock],
                          num_cached_blocks: int, num_full_blocks: int,
                          block_size: int) -> None:
        """Puts blocks[num_cached_blocks:num_full_blocks] of `request` in the prefix cache,
        keyed by the request's block hashes. Blocks already cached (prefix hits) are skipped."""
        hashes = request.block_hashes
        assert len(hashes) >= num_full_blocks, "block hashes lag the tokens"
        hash_to_block = self.cached_block_hash_to_block
        stored: list[int] = []
        for index in range(num_cached_blocks, num_full_blocks):
            block = blocks[index]
            if block.block_hash is not None:
                continue
            block_hash = hashes[index]
            if block_hash in hash_to_block:
                continue
            block.block_hash = block_hash
            hash_to_block[block_hash] = block
            stored.append(index)
        if stored and self.enable_kv_events:
            self._queue_stored_events(request, stored, block_size)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use, since their
        requests would cache into a half-cleared map."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_events:
            self._kv_event_queue.append(AllBlocksCleared())
        return True

    # ---- accounting -------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks referenced by requests (0..1)."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    # ---- events and evictions ---------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        events, self._kv_event_queue = self._kv_event_queue, []
        return events

    def carry_events_from(self, old: BlockPool) -> None:
        """This pool replaces `old`: the events `old` has not handed out yet come first, then
        (with events on) AllBlocksCleared, so subscribers forget the old pool's blocks."""
        events = old.take_events()
        if self.enable_kv_events:
            events.append(AllBlocksCleared())
        self._kv_event_queue[:0] = events

    def take_evicted_blocks(self) -> list[tuple[int, BlockHash]]:
        evicted, self._evicted_blocks = self._evicted_blocks, []
        return evicted

    def _queue_stored_events(self, request: Request, indices: list[int], block_size: int) -> None:
        # One BlockStored per contiguous run of newly cached blocks (a duplicate splits a run).
        hashes, tokens = request.block_hashes, request.all_token_ids
        start = 0
        for end in range(1, len(indices) + 1):
            if end < len(indices) and indices[end] == indices[end - 1] + 1:
                continue
            first, last = indices[start], indices[end - 1]
            hasher = request.block_hasher
            self._kv_event_queue.append(BlockStored(
                block_hashes=hashes[first:last + 1],
                parent_block_hash=hashes[first - 1] if first > 0 else None,
                token_ids=tokens[first * block_size:(last + 1) * block_size],
                block_size=block_size,
                lora_id=request.lora_id,
                extra_keys=[hasher.extra_keys(i, request.cache_salt, request.lora_id,
                                              request.mm_spans)
                            for i in range(first, last + 1)] if hasher is not None else [],
            ))
            start = end
