"""The Redis index (a real valkey-server with a password in the URL): what a node's Put,
spill and eviction write, prefix lookups across nodes, fingerprints that never mix, and the
entries of a node that went away."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llm_mesh.embedded import EmbeddedRedis
from services.common.kv_index import KVIndex
from tests.kvstore.conftest import running_servicer, stub_for
from tests.kvstore.test_data_plane import FP, blocks, put_messages


@pytest.fixture
async def index(redis_server: EmbeddedRedis) -> AsyncIterator[KVIndex]:
    assert ":s3cret@" in redis_server.url
    kv_index = KVIndex.connect(redis_server.url, f"test-{secrets.token_hex(4)}")
    yield kv_index
    await kv_index.close()


async def wait_until_gone(index: KVIndex, node_id: str, timeout_s: float = 10.0) -> None:
    """Polls the index until the node's liveness key has expired."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while node_id in await index.live_nodes():
        assert asyncio.get_running_loop().time() < deadline, f"{node_id} never expired"
        await asyncio.sleep(0.05)


async def test_put_spill_and_eviction_keep_the_index_true(index: KVIndex,
                                                          tmp_path: Path) -> None:
    items = blocks(4, size=1000)
    await index.register_node("node-a", "10.0.0.1:7000", ttl_s=30)
    async with running_servicer(1000, "node-a", index, tmp_path, disk_bytes=2000) as (
            _, address), stub_for(address) as stub:
        await stub.put(put_messages(items[:1]))
        entry = await index.get_entry(FP, items[0][0])
        assert entry is not None
        assert (entry.node, entry.tier, entry.size) == ("node-a", "cpu", 1000)
        await stub.put(put_messages(items[1:]))   # 0 and 1 spill to disk, then 0 is evicted
        assert await index.get_entry(FP, items[0][0]) is None
        assert (await index.get_entry(FP, items[1][0])).tier == "disk"
        assert (await index.get_entry(FP, items[3][0])).tier == "cpu"
        hashes = [h for h, _ in items]
        assert await index.lookup_prefix(FP, hashes) == []           # block 0 is gone
        assert await index.lookup_prefix(FP, hashes[1:]) == ["10.0.0.1:7000"] * 3
        assert await index.lookup_prefix("another-model", hashes[1:]) == []


async def test_a_prefix_spans_nodes_and_stops_at_a_dead_one(index: KVIndex) -> None:
    items = blocks(4)
    await index.register_node("node-a", "a:1", ttl_s=30)
    await index.register_node("node-b", "b:1", ttl_s=30)
    async with running_servicer(1 << 20, "node-a", index) as (_, address_a), \
            running_servicer(1 << 20, "node-b", index) as (_, address_b), \
            stub_for(address_a) as stub_a, stub_for(address_b) as stub_b:
        await stub_a.put(put_messages(items[:2]))
        await stub_b.put(put_messages(items[2:]))
        hashes = [h for h, _ in items]
        assert await index.lookup_prefix(FP, hashes) == ["a:1", "a:1", "b:1", "b:1"]
        assert sorted(await index.live_nodes()) == ["node-a", "node-b"]
        # node-b stops renewing its liveness key; once it expires, its blocks are gone
        await index.register_node("node-b", "b:1", ttl_s=0.2)
        await wait_until_gone(index, "node-b")
        assert await index.lookup_prefix(FP, hashes) == ["a:1", "a:1"]
        assert await index.live_nodes() == {"node-a": "a:1"}
        assert await index.sweep_dead_nodes("node-a") == 2
        assert await index.get_entry(FP, items[2][0]) is None
        assert await index.get_entry(FP, items[0][0]) is not None


async def test_storing_a_held_block_again_restores_its_lost_index_entry(index: KVIndex) -> None:
    items = blocks(2)
    async with running_servicer(1 << 20, "node-a", index) as (_, address), \
            stub_for(address) as stub:
        await stub.put(put_messages(items))
        await index.remove_entries("node-a", FP, [items[0][0]])   # expired, or Redis lost it
        assert await index.get_entry(FP, items[0][0]) is None
        reply = await stub.put(put_messages(items[:1]))
        assert reply.num_stored == 1
        entry = await index.get_entry(FP, items[0][0])
        assert entry is not None and (entry.node, entry.tier) == ("node-a", "cpu")


async def test_a_read_refreshes_entries_and_never_recreates_a_lost_one(index: KVIndex) -> None:
    await index.put_entries("node-a", FP, [(b"h" * 32, "cpu", 10, 123)], ttl_s=30)
    before = await index.get_entry(FP, b"h" * 32)
    await index.touch(FP, [b"h" * 32, b"gone" * 8], ttl_s=30)
    after = await index.get_entry(FP, b"h" * 32)
    assert before is not None and after is not None and after.last_use >= before.last_use
    assert await index.get_entry(FP, b"gone" * 8) is None   # not a half entry


async def test_entries_expire_with_their_ttl(index: KVIndex) -> None:
    loop = asyncio.get_running_loop()
    put_at = loop.time()
    await index.put_entries("node-a", FP, [(b"h" * 32, "cpu", 10, 123)], ttl_s=1.0)
    assert await index.get_entry(FP, b"h" * 32) is not None
    while await index.get_entry(FP, b"h" * 32) is not None:
        assert loop.time() - put_at < 10.0, "the entry outlived its TTL"
        await asyncio.sleep(0.05)
    assert loop.time() - put_at >= 0.9   # it lived out its TTL, not less
