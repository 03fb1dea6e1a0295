"""The kvstore node over real gRPC: Put / Get / Lookup / Delete, checksums, the CPU and disk
tiers' bounds and LRU order, and a restarted node keeping its disk tier."""

from __future__ import annotations

import os
from pathlib import Path

from services.common import wire
from services.common.kv_data_plane import block_checksum
from tests.kvstore.conftest import running_servicer, stub_for

FP = "model-a"


def blocks(n: int, size: int = 1000, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """(hash, payload) pairs."""
    return [(f"h{seed}-{i}".encode().ljust(32, b"."), os.urandom(size)) for i in range(n)]


def put_messages(items: list[tuple[bytes, bytes]], fingerprint: str = FP) -> list[wire.PutBlock]:
    messages = [wire.PutBlock(block_hash=h, data=d, checksum=block_checksum(d)) for h, d in items]
    messages[0].fingerprint = fingerprint
    return messages


async def get_all(stub: wire.KvStoreStub, hashes: list[bytes],
                  fingerprint: str = FP) -> list[wire.StoredBlock]:
    return [b async for b in stub.get(wire.GetRequest(fingerprint=fingerprint,
                                                      block_hashes=hashes))]


async def test_put_get_lookup_delete_roundtrip() -> None:
    items = blocks(5)
    async with running_servicer(cpu_bytes=1 << 20) as (_, address), stub_for(address) as stub:
        reply = await stub.put(put_messages(items))
        assert (reply.num_stored, reply.num_rejected) == (5, 0)
        got = await get_all(stub, [h for h, _ in items])
        assert [(b.block_hash, b.data) for b in got] == items
        assert all(block_checksum(b.data) == b.checksum for b in got)
        # Get and Lookup stop at the first block the node lacks: a prefix.
        hashes = [items[0][0], items[1][0], b"missing".ljust(32), items[2][0]]
        assert len(await get_all(stub, hashes)) == 2
        lookup = await stub.lookup(wire.LookupRequest(fingerprint=FP, block_hashes=hashes))
        assert lookup.num_prefix_blocks == 2
        # Another fingerprint (model or dtype) never sees these blocks.
        assert await get_all(stub, [items[0][0]], fingerprint="model-b") == []
        deleted = await stub.delete(wire.DeleteRequest(fingerprint=FP,
                                                       block_hashes=[items[0][0]]))
        assert deleted.num_deleted == 1
        assert await get_all(stub, [items[0][0]]) == []
        assert (await stub.delete(wire.DeleteRequest(fingerprint=FP))).num_deleted == 4


async def test_a_block_damaged_in_flight_is_refused() -> None:
    items = blocks(3)
    messages = put_messages(items)
    messages[1].checksum ^= 1
    async with running_servicer(cpu_bytes=1 << 20) as (servicer, address), \
            stub_for(address) as stub:
        reply = await stub.put(messages)
        assert (reply.num_stored, reply.num_rejected) == (2, 1)
        assert servicer.store.medium_of((FP, items[1][0])) is None


async def test_cpu_tier_is_bounded_with_lru_eviction() -> None:
    items = blocks(10, size=1000)
    async with running_servicer(cpu_bytes=4500) as (servicer, address), \
            stub_for(address) as stub:
        await stub.put(put_messages(items[:4]))
        await get_all(stub, [items[0][0]])          # block 0 becomes most recently used
        await stub.put(put_messages(items[4:6]))    # evicts the least recently used: 1, 2
        held = [h for h, _ in items if servicer.store.medium_of((FP, h)) is not None]
        assert held == [items[i][0] for i in (0, 3, 4, 5)]
        assert servicer.store.cpu.used_bytes == 4000 <= 4500
        # A block larger than the whole tier is refused, not stored.
        reply = await stub.put(put_messages(blocks(1, size=5000, seed=1)))
        assert reply.num_rejected == 1


async def test_disk_tier_takes_cpu_victims_and_survives_a_restart(tmp_path: Path) -> None:
    items = blocks(8, size=1000)
    async with running_servicer(cpu_bytes=2000, disk_dir=tmp_path, disk_bytes=4000) as (
            servicer, address), stub_for(address) as stub:
        for item in items:
            await stub.put(put_messages([item]))
        store = servicer.store
        assert store.cpu.used_bytes <= 2000 and store.disk is not None
        assert store.disk.used_bytes <= 4000
        on_disk = sum(f.stat().st_size - 8 for f in tmp_path.glob("*/*"))
        assert on_disk == store.disk.used_bytes
        assert [store.medium_of((FP, h)) for h, _ in items] == \
            [None, None, "disk", "disk", "disk", "disk", "cpu", "cpu"]
        got = await get_all(stub, [h for h, _ in items[2:]])
        assert [b.data for b in got] == [d for _, d in items[2:]]
    # A new node on the same directory keeps the disk tier (CPU tier contents are gone).
    async with running_servicer(cpu_bytes=2000, disk_dir=tmp_path, disk_bytes=4000) as (
            servicer, address), stub_for(address) as stub:
        adopted = servicer.store.adopt_disk()
        assert {key for key, _, _ in adopted} == {(FP, h) for h, _ in items[2:6]}
        got = await get_all(stub, [items[2][0]])
        assert got[0].data == items[2][1] and block_checksum(got[0].data) == got[0].checksum


async def test_memory_stays_inside_the_tier_bounds_under_a_soak(tmp_path: Path) -> None:
    """Bounded soak: 40x the CPU tier through Put, with Gets and Lookups in between."""
    cpu_bytes, disk_bytes, size = 64 * 1024, 128 * 1024, 4096
    async with running_servicer(cpu_bytes=cpu_bytes, disk_dir=tmp_path,
                                disk_bytes=disk_bytes) as (servicer, address), \
            stub_for(address) as stub:
        store = servicer.store
        for round_ in range(40):
            items = blocks(16, size=size, seed=round_)
            await stub.put(put_messages(items))
            await get_all(stub, [h for h, _ in items[-4:]])
            await stub.lookup(wire.LookupRequest(fingerprint=FP,
                                                 block_hashes=[h for h, _ in items]))
            assert store.cpu.used_bytes <= cpu_bytes
            assert store.disk is not None and store.disk.used_bytes <= disk_bytes
            assert len(store.cpu) * size == store.cpu.used_bytes
            on_disk = sum(f.stat().st_size - 8 for f in tmp_path.glob("*/*"))
            assert on_disk == store.disk.used_bytes
