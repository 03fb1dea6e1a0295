"""The kvstore's block index in Redis: which node holds which KV block.

Kvstore nodes write it (services/kvstore); schedulers read it to find, before a request runs,
how many of its leading blocks some node holds (services/scheduler/kv/lookup.py).
Keys, under `llm-mesh:{namespace}`:

  blk:{fingerprint}:{hash hex}  hash {node, tier, size, checksum, last_use}, TTL entry_ttl_s
  node:{node id}                the node's gRPC address, TTL node_ttl_s (its liveness)
  nodes                         set of node ids (discovery, and who sweeps whom)
  node-blocks:{node id}         set of the node's block keys (to drop them when it dies)

The fingerprint names the model, dtype, block size and KV layout, so blocks of different
models or dtypes never share a key. A lookup trusts an entry only while its node's liveness
key exists; a live node sweeps the entries of nodes whose liveness key expired.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from services.common.settings import setting

# Deletes an entry only if it still names this node: another node may have re-stored it.
_DELETE_IF_OWNER = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('HGET', key, 'node') == ARGV[1] then n = n + redis.call('DEL', key) end
end
return n
"""
# A read refreshes entries that still exist; one that expired meanwhile is not recreated
# with only a last_use field (HSET on a missing key would).
_TOUCH_IF_PRESENT = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then
    redis.call('HSET', key, 'last_use', ARGV[1])
    redis.call('PEXPIRE', key, ARGV[2])
  end
end
return 0
"""


@dataclass
class KVIndexSettings:
    redis_url: str = setting("", "Redis (or Valkey) URL of the kvstore's block index, e.g. "
                             "redis://:password@host:6379/0; empty: no kvstore", secret=True)


@dataclass(frozen=True)
class IndexEntry:
    node: str
    tier: str
    size: int
    checksum: int
    last_use: float


class KVIndex:
    """Typed access to the index; every call is one Redis round trip (pipelined)."""

    def __init__(self, client: aioredis.Redis, namespace: str) -> None:
        self.client = client
        self.prefix = f"llm-mesh:{namespace}"
        self._delete_if_owner = client.register_script(_DELETE_IF_OWNER)
        self._touch_if_present = client.register_script(_TOUCH_IF_PRESENT)

    @classmethod
    def connect(cls, url: str, namespace: str, timeout_s: float = 2.0) -> KVIndex:
        return cls(aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s), namespace)

    async def close(self) -> None:
        await self.client.aclose()

    # ---- keys
    def block_key(self, fingerprint: str, block_hash: bytes) -> str:
        return f"{self.prefix}:blk:{fingerprint}:{block_hash.hex()}"

    def _node_key(self, node_id: str) -> str:
        return f"{self.prefix}:node:{node_id}"

    def _node_blocks_key(self, node_id: str) -> str:
        return f"{self.prefix}:node-blocks:{node_id}"

    # ---- nodes
    async def register_node(self, node_id: str, address: str, ttl_s: float) -> None:
        """Announces (or keeps alive) a node; call it more often than ttl_s."""
        async with self.client.pipeline(transaction=False) as pipe:
            pipe.set(self._node_key(node_id), address, px=int(ttl_s * 1000))
            pipe.sadd(f"{self.prefix}:nodes", node_id)
            await pipe.execute()

    async def unregister_node(self, node_id: str) -> None:
        await self.client.delete(self._node_key(node_id))

    async def live_nodes(self) -> dict[str, str]:
        """Node id -> gRPC address, for every node whose liveness key exists."""
        node_ids = sorted(m.decode() for m in await self.client.smembers(f"{self.prefix}:nodes"))
        if not node_ids:
            return {}
        addresses = await self.client.mget([self._node_key(n) for n in node_ids])
        return {n: a.decode() for n, a in zip(node_ids, addresses) if a is not None}

    async def sweep_dead_nodes(self, own_id: str) -> int:
        """Drops the entries of nodes whose liveness expired; returns how many entries."""
        node_ids = [m.decode() for m in await self.client.smembers(f"{self.prefix}:nodes")]
        dropped = 0
        for node_id in node_ids:
            if node_id == own_id or await self.client.exists(self._node_key(node_id)):
                continue
            keys = [k.decode() for k in await self.client.smembers(self._node_blocks_key(node_id))]
            for start in range(0, len(keys), 512):
                dropped += int(await self._delete_if_owner(keys[start:start + 512], [node_id]))
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.delete(self._node_blocks_key(node_id))
                pipe.srem(f"{self.prefix}:nodes", node_id)
                await pipe.execute()
        return dropped

    # ---- entries (written by the node that holds the block)
    async def put_entries(self, node_id: str, fingerprint: str,
                          blocks: Sequence[tuple[bytes, str, int, int]], ttl_s: float) -> None:
        """Records (hash, tier, size, checksum) blocks as held by node_id."""
        if not blocks:
            return
        now = time.time()
        keys = [self.block_key(fingerprint, h) for h, _, _, _ in blocks]
        async with self.client.pipeline(transaction=False) as pipe:
            for key, (_, tier, size, checksum) in zip(keys, blocks):
                pipe.hset(key, mapping={"node": node_id, "tier": tier, "size": size,
                                        "checksum": checksum, "last_use": now})
                pipe.pexpire(key, int(ttl_s * 1000))
            pipe.sadd(self._node_blocks_key(node_id), *keys)
            pipe.pexpire(self._node_blocks_key(node_id), int(ttl_s * 1000))
            await pipe.execute()

    async def touch(self, fingerprint: str, block_hashes: Sequence[bytes], ttl_s: float) -> None:
        """A read: the entries live another ttl_s and record their last use."""
        if block_hashes:
            await self._touch_if_present([self.block_key(fingerprint, h) for h in block_hashes],
                                         [time.time(), int(ttl_s * 1000)])

    async def remove_entries(self, node_id: str, fingerprint: str,
                             block_hashes: Sequence[bytes]) -> int:
        if not block_hashes:
            return 0
        keys = [self.block_key(fingerprint, h) for h in block_hashes]
        removed = int(await self._delete_if_owner(keys, [node_id]))
        await self.client.srem(self._node_blocks_key(node_id), *keys)
        return removed

    # ---- reads
    async def get_entry(self, fingerprint: str, block_hash: bytes) -> IndexEntry | None:
        fields = await self.client.hgetall(self.block_key(fingerprint, block_hash))
        if not fields:
            return None
        return IndexEntry(fields[b"node"].decode(), fields[b"tier"].decode(),
                          int(fields[b"size"]), int(fields[b"checksum"]),
                          float(fields[b"last_use"]))

    async def lookup_prefix(self, fingerprint: str, block_hashes: Sequence[bytes]) -> list[str]:
        """The addresses of the nodes holding the leading blocks of `block_hashes`, up to the
        first block no live node holds (an empty list: not even the first)."""
        if not block_hashes:
            return []
        async with self.client.pipeline(transaction=False) as pipe:
            for block_hash in block_hashes:
                pipe.hget(self.block_key(fingerprint, block_hash), "node")
            owners = await pipe.execute()
        leading: list[str] = []
        for owner in owners:
            if owner is None:
                break
            leading.append(owner.decode())
        if not leading:
            return []
        distinct = sorted(set(leading))
        addresses = await self.client.mget([self._node_key(n) for n in distinct])
        address_of = {n: a.decode() for n, a in zip(distinct, addresses) if a is not None}
        prefix: list[str] = []
        for owner in leading:
            address = address_of.get(owner)
            if address is None:
                break   # a node that went away: its blocks are gone with it
            prefix.append(address)
        return prefix
