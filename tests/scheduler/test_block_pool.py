"""Unit tests of the free queue and the block pool: eviction order, null block, events."""

from __future__ import annotations

import pytest

from services.common.block_hash import BlockHasher
from services.scheduler.core import AllBlocksCleared, BlockRemoved, BlockStored, Request
from services.scheduler.core.block_pool import BlockPool
from services.scheduler.core.kv_cache_manager import KVCacheManager
from services.scheduler.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [block.block_id for block in blocks]


def test_free_queue_orders_and_removes_from_the_middle() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.popleft() is blocks[0]
    assert ids(queue.popleft_n(2)) == [1, 3]
    queue.append(blocks[0])
    queue.append_n([blocks[2], blocks[1]])
    assert ids(queue.get_all_free_blocks()) == [4, 5, 0, 2, 1]
    assert queue.num_free_blocks == 5
    with pytest.raises(ValueError):
        queue.popleft_n(6)
    assert ids(queue.popleft_n(5)) == [4, 5, 0, 2, 1]
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(RuntimeError):
        queue.remove(blocks[3])


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5, enable_caching=True)
    blocks = pool.get_new_blocks(4)
    assert 0 not in ids(blocks) and pool.get_num_free_blocks() == 0
    assert pool.get_usage() == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.get_usage() == 0.0
    with pytest.raises(ValueError):
        BlockPool(1, enable_caching=True)


def test_request_frees_tail_first_and_cached_blocks_survive_until_reused() -> None:
    manager = KVCacheManager(num_blocks=9, block_size=4, max_model_len=64, enable_caching=True)
    hasher = BlockHasher(4)
    first = Request("a", list(range(13)), max_tokens=2, arrival_time=0, block_hasher=hasher)
    manager.allocate_slots(first, 13)
    table = manager.get_block_ids("a")
    assert table == [1, 2, 3, 4]
    manager.free(first)
    # Tail first, after the blocks that were never used.
    assert ids(manager.block_pool.free_block_queue.get_all_free_blocks()) == [5, 6, 7, 8,
                                                                              4, 3, 2, 1]
    # A new request with the same prefix still hits the freed (cached) blocks.
    second = Request("b", list(range(12)) + [99], max_tokens=2, arrival_time=0,
                     block_hasher=hasher)
    computed, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 12 and computed.get_block_ids() == [1, 2, 3]
    manager.free(second)
    # Reusing every free block evicts the cached ones (the tail block 4 held no full block).
    manager.block_pool.get_new_blocks(8)
    assert not manager.block_pool.cached_block_hash_to_block


def test_kv_events_are_queued_as_blocks_change() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2, max_model_len=64, enable_caching=True,
                             enable_kv_events=True)
    hasher = BlockHasher(2)
    request = Request("a", [5, 6, 7, 8, 9], max_tokens=1, arrival_time=0, lora_id=3,
                      block_hasher=hasher)
    manager.allocate_slots(request, 3)
    request.num_computed_tokens = 3
    manager.allocate_slots(request, 2)
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    assert events[0].block_hashes == request.block_hashes[:1]
    assert events[0].parent_block_hash is None and events[0].token_ids == [5, 6]
    assert events[1].parent_block_hash == request.block_hashes[0]
    assert events[1].token_ids == [7, 8] and events[1].lora_id == 3
    assert manager.take_events() == []
    manager.free(request)
    manager.block_pool.get_new_blocks(3)   # tail first: evicts block 2's hash, then block 1's
    assert manager.take_events() == [BlockRemoved(request.block_hashes[::-1])]
    manager.block_pool.free_blocks(manager.block_pool.blocks[1:])
    assert manager.reset_prefix_cache()
    assert manager.take_events() == [AllBlocksCleared()]


def test_a_replacing_manager_carries_the_old_events_then_clears() -> None:
    old = KVCacheManager(num_blocks=4, block_size=2, max_model_len=64, enable_caching=True,
                         enable_kv_events=True)
    request = Request("a", [5, 6, 7], max_tokens=1, arrival_time=0,
                      block_hasher=BlockHasher(2))
    old.allocate_slots(request, 3)
    new = KVCacheManager(num_blocks=8, block_size=2, max_model_len=64, enable_caching=True,
                         enable_kv_events=True)
    new.carry_events_from(old)
    events = new.take_events()
    assert [type(e) for e in events] == [BlockStored, AllBlocksCleared]
    assert old.take_events() == [] and new.take_events() == []


def test_evictions_are_recorded_only_when_enabled() -> None:
    for enabled in (False, True):
        manager = KVCacheManager(num_blocks=3, block_size=2, max_model_len=64,
                                 enable_caching=True, enable_eviction_records=enabled)
        request = Request("a", [5, 6, 7], max_tokens=1, arrival_time=0,
                          block_hasher=BlockHasher(2))
        manager.allocate_slots(request, 3)
        first = manager.req_to_blocks["a"][0]
        manager.free(request)
        manager.block_pool.get_new_blocks(2)   # reuses both; only the first held a hash
        expected = [(first.block_id, request.block_hashes[0])] if enabled else []
        assert manager.take_evicted_blocks() == expected
        assert manager.take_evicted_blocks() == []


def test_no_events_without_the_flag() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=2, max_model_len=64, enable_caching=True)
    request = Request("a", [5, 6, 7], max_tokens=1, arrival_time=0,
                      block_hasher=BlockHasher(2))
    manager.allocate_slots(request, 3)
    assert manager.take_events() == []


def test_caching_off_never_hits_or_hashes() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=2, max_model_len=64, enable_caching=False)
    hasher = BlockHasher(2)
    for name in ("a", "b"):
        request = Request(name, [1, 2, 3, 4, 5], max_tokens=1, arrival_time=0,
                          block_hasher=hasher)
        assert manager.get_computed_blocks(request) == (manager.empty_kv_cache_blocks, 0)
        manager.allocate_slots(request, 5)
    assert not manager.block_pool.cached_block_hash_to_block
    assert manager.take_prefix_cache_stats().queries == 0
