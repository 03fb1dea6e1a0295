"""KV cache events, after vLLM's distributed/kv_events.py: what a router needs to mirror our
prefix cache. The block pool queues them as blocks change; a publisher (a later issue) takes
them, stamps a publisher id and a sequence number, and sends them."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.block_hash import BlockHash


@dataclass(slots=True, frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    """Hash of the block before the first one here; None when they start the sequence."""
    token_ids: list[int]
    block_size: int
    lora_id: int
    extra_keys: list[bytes] = field(default_factory=list)
    """Per block, the extra keys its hash mixed in (BlockHasher.extra_keys; b"" if none)."""


@dataclass(slots=True, frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]


@dataclass(slots=True, frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
