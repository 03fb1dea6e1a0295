"""The kvstore's gRPC methods over its BlockStore, and what each change implies for the Redis
index and the KV event stream.

The index is written before Put answers, so a writer that saw its Put acknowledged (a
prefill producer) knows every scheduler's lookup finds the blocks. A Redis outage only
costs index updates (blocks are still stored and served); it never fails a call.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import structlog

from services.common import wire
from services.common.kv_data_plane import block_checksum
from services.common.kv_event_stream import KVEventPublisher
from services.common.kv_index import KVIndex
from services.common.metrics import KVStoreMetrics
from services.kvstore.block_store import BlockStore, Change, Medium
from services.kvstore.tiers import Block

log = structlog.get_logger(__name__)

# Events name blocks of one model: each fingerprint has its own publisher (and sequence).
PublisherFor = Callable[[str], Awaitable[KVEventPublisher]]
_MEDIUM = {Medium.CPU: wire.KvMedium.CPU, Medium.DISK: wire.KvMedium.DISK}


class KVStoreServicer(wire.KvStoreBase):
    def __init__(self, store: BlockStore, node_id: str, metrics: KVStoreMetrics,
                 index: KVIndex | None, index_ttl_s: float,
                 publisher_for: PublisherFor | None = None) -> None:
        self.store = store
        self.node_id = node_id
        self.metrics = metrics
        self.index = index
        self.index_ttl_s = index_ttl_s
        self.publisher_for = publisher_for   # fingerprint -> its event publisher

    # ---- gRPC methods
    async def put(self, put_block_iterator: AsyncIterator[wire.PutBlock]) -> wire.PutReply:
        fingerprint = ""
        changes: list[Change] = []
        num_stored = num_rejected = 0
        async for message in put_block_iterator:
            fingerprint = message.fingerprint or fingerprint
            if not fingerprint or block_checksum(message.data) != message.checksum:
                num_rejected += 1   # damaged in flight, or nameless: never store it
                continue
            result = self.store.put((fingerprint, message.block_hash),
                                    Block(message.data, message.checksum))
            if result is None:
                num_rejected += 1
                continue
            num_stored += 1
            changes += result
            self.metrics.put_bytes.inc(len(message.data))
        self.metrics.put_blocks.inc(num_stored)
        self.metrics.rejected_blocks.inc(num_rejected)
        await self.apply_changes(changes)
        return wire.PutReply(num_stored=num_stored, num_rejected=num_rejected)

    async def get(self, get_request: wire.GetRequest) -> AsyncIterator[wire.StoredBlock]:
        fingerprint = get_request.fingerprint
        served: list[bytes] = []
        for block_hash in get_request.block_hashes:
            block = self.store.get((fingerprint, block_hash))
            if block is None:
                self.metrics.get_misses.inc()
                break
            served.append(block_hash)
            self.metrics.get_bytes.inc(len(block.data))
            yield wire.StoredBlock(block_hash=block_hash, data=block.data,
                                   checksum=block.checksum)
        self.metrics.get_blocks.inc(len(served))
        if served and self.index is not None:
            try:
                await self.index.touch(fingerprint, served, self.index_ttl_s)
            except Exception as exc:
                log.warning("index not touched", error=str(exc))

    async def lookup(self, lookup_request: wire.LookupRequest) -> wire.LookupReply:
        return wire.LookupReply(num_prefix_blocks=self.store.lookup(
            lookup_request.fingerprint, lookup_request.block_hashes))

    async def delete(self, delete_request: wire.DeleteRequest) -> wire.DeleteReply:
        fingerprint = delete_request.fingerprint
        keys = ([(fingerprint, h) for h in delete_request.block_hashes]
                if delete_request.block_hashes else self.store.keys_of(fingerprint))
        changes = self.store.delete(keys)
        await self.apply_changes(changes)
        return wire.DeleteReply(num_deleted=len({c.key for c in changes}))

    # ---- index and events
    async def apply_changes(self, changes: Sequence[Change]) -> None:
        self.update_gauges()
        if not changes:
            return
        self.metrics.evicted_blocks.inc(sum(1 for c in changes if not c.is_stored))
        if self.index is not None:
            try:
                await self._update_index(changes)
            except Exception as exc:
                log.warning("index not updated", error=str(exc), num_changes=len(changes))
        if self.publisher_for is not None:
            await self._publish_events(changes)

    async def _update_index(self, changes: Sequence[Change]) -> None:
        assert self.index is not None
        stored: dict[str, dict[bytes, tuple[bytes, str, int, int]]] = defaultdict(dict)
        removed: dict[str, list[bytes]] = defaultdict(list)
        for change in changes:
            (fingerprint, block_hash), medium = change.key, self.store.medium_of(change.key)
            if medium is None:
                removed[fingerprint].append(block_hash)
            elif change.is_stored and change.medium is medium:
                stored[fingerprint][block_hash] = (block_hash, medium.value, change.size,
                                                   change.checksum)
        for fingerprint, entries in stored.items():
            await self.index.put_entries(self.node_id, fingerprint, list(entries.values()),
                                         self.index_ttl_s)
        for fingerprint, hashes in removed.items():
            await self.index.remove_entries(self.node_id, fingerprint, hashes)

    async def _publish_events(self, changes: Sequence[Change]) -> None:
        assert self.publisher_for is not None
        by_fingerprint: dict[str, list[wire.KvEvent]] = defaultdict(list)
        for change in changes:   # in order: a spill is removed(cpu) then stored(disk)
            if change.is_refresh:
                continue   # consumers already know it
            fingerprint, block_hash = change.key
            medium = _MEDIUM[change.medium]
            event = (wire.KvEvent(stored=wire.BlockStored(block_hashes=[block_hash],
                                                          medium=medium))
                     if change.is_stored else
                     wire.KvEvent(removed=wire.BlockRemoved(block_hashes=[block_hash],
                                                            medium=medium)))
            by_fingerprint[fingerprint].append(event)
        for fingerprint, events in by_fingerprint.items():
            (await self.publisher_for(fingerprint)).publish(events)

    def update_gauges(self) -> None:
        self.metrics.tier_bytes.labels("cpu").set(self.store.cpu.used_bytes)
        self.metrics.tier_blocks.labels("cpu").set(len(self.store.cpu))
        if self.store.disk is not None:
            self.metrics.tier_bytes.labels("disk").set(self.store.disk.used_bytes)
            self.metrics.tier_blocks.labels("disk").set(len(self.store.disk))

    def snapshot_events(self, fingerprint: str) -> list[wire.KvEvent]:
        return [wire.KvEvent(stored=wire.BlockStored(block_hashes=[key[1]],
                                                     medium=_MEDIUM[medium]))
                for key, medium in self.store.all_keys() if key[0] == fingerprint]
