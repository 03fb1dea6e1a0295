"""Per-request block tables over the block pool, after vLLM's kv_cache_manager.py.

The scheduler asks two questions here: "how much of this request is already cached?"
(`get_computed_blocks`) and "give it room for n more tokens" (`allocate_slots`). It gets
`KVCacheBlocks` back and never touches the pool's internals.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.block_hash import BlockHash
from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.kv_cache_utils import KVCacheBlock
from services.scheduler.core.kv_events import KVCacheEvent
from services.scheduler.core.output import StateCheckpointOps
from services.scheduler.core.request import Request


class KVCacheBlocks:
    """An allocation result: opaque to the scheduler except for its block ids."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.blocks = blocks

    def get_block_ids(self) -> list[int]:
        return [block.block_id for block in self.blocks]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0
    """Tokens looked up (the whole request at each admission)."""
    hits: int = 0
    """Tokens found cached."""
    requests: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool, enable_kv_events: bool = False,
                 enable_eviction_records: bool = False) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_events,
                                    enable_eviction_records)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request have been offered to the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.empty_kv_cache_blocks = KVCacheBlocks(())
        self._num_frees_kept = 0   # block_pool.num_frees at the last keep_prefixes

    @property
    def num_usable_blocks(self) -> int:
        return self.block_pool.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest run of the request's leading full blocks found in the prefix cache,
        and the tokens it covers. Nothing when caching is off or the request skips it."""
        if not self.enable_caching or request.skip_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        # NOTE: the last token always runs, to produce the logits of the next one; with
        # whole-block hits that may recompute up to one block.
        max_hit_blocks = min((request.num_tokens - 1) // self.block_size,
                             len(request.block_hashes))
        lookup = self.block_pool.cached_block_hash_to_block.get
        hashes = request.block_hashes
        computed: list[KVCacheBlock] = []
        for index in range(max_hit_blocks):
            block = lookup(hashes[index])
            if block is None:
                break
            computed.append(block)
        if not computed:
            return self.empty_kv_cache_blocks, 0
        return KVCacheBlocks(computed), len(computed) * self.block_size

    def keep_prefix(self, request: Request) -> None:
        """The request joins the queue: the free blocks of its cached prefix go to the back
        of the eviction order, so the history it came back for outlasts idle caches while it
        waits (measured: turns queued 6-15 s behind a busy engine lost the history they were
        routed to it for to the running requests' new blocks, docs/benchmarks.md 11j)."""
        computed, _ = self.get_computed_blocks(request)
        self.block_pool.refresh(computed.blocks)

    def keep_prefixes(self, next_in_line: Sequence[Request]) -> None:
        """keep_prefix again for the requests next in line (the first runs first, so its
        prefix goes last), once blocks freed since the last call have queued behind them:
        finished requests' caches are evicted before the history a queued turn waits for.
        Between frees it does nothing: only a free queues blocks behind them."""
        pool = self.block_pool
        if pool.num_frees == self._num_frees_kept:
            return
        self._num_frees_kept = pool.num_frees
        for request in reversed(next_in_line):
            self.keep_prefix(request)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_new_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False) -> KVCacheBlocks | None:
        """Room for `num_new_tokens` after the request's computed tokens (including the
        prefix hits `new_computed_blocks`, on its first allocation). Returns the newly
        allocated blocks, or None when too few blocks are free (nothing changes then).

        Blocks that will be full once this step runs are cached right away, so a request
        scheduled later in the same step (n>1 samples of one prompt) already hits them.
        With `delay_cache_blocks` (blocks the kvstore will fill) they are cached only once
        their KV is in place (`cache_blocks`)."""
        block_size = self.block_size
        pool = self.block_pool
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        is_first = req_blocks is None
        if req_blocks is None:
            req_blocks = []
        num_tokens_after = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_new_blocks = (num_tokens_after + block_size - 1) // block_size - len(req_blocks)

        computed = new_computed_blocks.blocks if new_computed_blocks is not None else ()
        if computed:
            assert not req_blocks, "prefix hits apply only to a request's first allocation"
            num_new_blocks -= len(computed)
            # A hit block that is free leaves the free queue too: count it against it.
            num_touched_free = sum(1 for block in computed if block.ref_cnt == 0)
            if max(num_new_blocks, 0) + num_touched_free > pool.get_num_free_blocks():
                return None
            pool.touch(computed)
            req_blocks.extend(computed)
            self.num_cached_block[request_id] = len(computed)
        elif num_new_blocks > pool.free_block_queue.num_free_blocks:
            return None

        result = self.empty_kv_cache_blocks
        if num_new_blocks > 0:
            new_blocks = pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            result = KVCacheBlocks(new_blocks)
        if is_first:
            self.req_to_blocks[request_id] = req_blocks
            self._record_prefix_cache_query(request, num_new_computed_tokens)

        if not delay_cache_blocks:
            self.cache_blocks(request, num_tokens_after)
        return result

    def align_prefill(self, request: Request, num_computed_tokens: int,
                      num_new_tokens: int) -> int:
        """How many of `num_new_tokens` prompt tokens a chunk runs: all of them here; a
        hybrid engine ends chunks where it keeps a state (hybrid_kv_cache_manager.py)."""
        return num_new_tokens

    def trim_drafts(self, request: Request, num_drafts: int) -> int:
        """How many of `num_drafts` drafts a decode of `request` verifies: all of them here;
        a hybrid engine keeps its checkpoint saves out of steps with drafts
        (hybrid_kv_cache_manager.py)."""
        return num_drafts

    def plan_state_checkpoints(self, new_reqs: dict[Request, int],
                               running_reqs: dict[Request, int]) -> StateCheckpointOps | None:
        """A hybrid engine's state copies for a step (hybrid_kv_cache_manager.py); None."""
        return None

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Offers the request's full blocks up to `num_computed_tokens` to the prefix cache."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        num_full_blocks = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_full_blocks > num_cached:
            self.block_pool.cache_full_blocks(request, self.req_to_blocks[request_id],
                                              num_cached, num_full_blocks, self.block_size)
            self.num_cached_block[request_id] = num_full_blocks

    def free(self, request: Request) -> None:
        """Releases the request's blocks tail first, so its most specific blocks (least
        likely to be shared) are evicted before its prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_block.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_prefix_cache_stats(self) -> PrefixCacheStats:
        """The counts since the previous call, and starts new ones."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def get_cached_block_hashes(self) -> list[BlockHash]:
        """Every hash in the prefix cache (a snapshot for late event subscribers)."""
        return list(self.block_pool.cached_block_hash_to_block)

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def carry_events_from(self, old: KVCacheManager) -> None:
        """This manager replaces `old` (the pool was resized): its events still reach
        subscribers, followed by AllBlocksCleared."""
        self.block_pool.carry_events_from(old.block_pool)

    def take_evicted_blocks(self) -> list[tuple[int, BlockHash]]:
        """(block id, hash) of cached blocks reused since the last call (when recorded)."""
        return self.block_pool.take_evicted_blocks()

    def _record_prefix_cache_query(self, request: Request, num_hit_tokens: int) -> None:
        # Counted once per admission (a resume counts again, as in vLLM), not per attempt:
        # a request that waits for blocks looks itself up again every step.
        if self.enable_caching and not request.skip_prefix_cache:
            stats = self.prefix_cache_stats
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens
