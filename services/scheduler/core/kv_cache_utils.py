"""KV cache blocks and the free list that orders their eviction (vLLM's kv_cache_utils.py)."""

from __future__ import annotations

from collections.abc import Iterable

from services.common.block_hash import BlockHash


class KVCacheBlock:
    """One block of `block_size` token slots in the worker's KV tensors."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        """Set while the block is in the prefix cache (full, hashed); kept after the block is
        freed and cleared only when it is popped for reuse."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={cached})"


class FreeKVCacheBlockQueue:
    """The free blocks, as a doubly linked list threaded through the blocks themselves.

    Eviction order (front = next to be reused):
      1. the least recently freed block comes first (LRU);
      2. blocks freed together keep the order they were given in; a request frees its blocks
         tail first, so its most specific blocks (unlikely to be shared) are evicted before
         the prefix other requests may hit;
      3. a request joining the queue moves the free blocks of its cached prefix to the back
         (KVCacheManager.keep_prefix), and the requests next in line do so again once other
         blocks are freed behind them (keep_prefixes), so what they wait for goes last.
    A prefix-cache hit takes a free block out of the middle in O(1) (`remove`), which is why
    this is a linked list and not a deque. Sentinel head/tail nodes keep every operation
    branch-free.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        previous = self._head
        for block in blocks:
            previous.next_free_block = block
            block.prev_free_block = previous
            previous = block
        previous.next_free_block = self._tail
        self._tail.prev_free_block = previous

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free block")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} left")
        blocks = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            following = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = following
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Takes `block` out from anywhere in the queue in O(1)."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Front to back (eviction order); for tests and debugging."""
        blocks = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks

    def _unlink(self, block: KVCacheBlock) -> None:
        prev, following = block.prev_free_block, block.next_free_block
        assert prev is not None and following is not None
        prev.next_free_block = following
        following.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
