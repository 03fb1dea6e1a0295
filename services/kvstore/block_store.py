"""One kvstore node's blocks across its tiers. No I/O besides the disk tier's files: the
gRPC servicer turns the changes each call returns into index writes and KV events.

A new block enters the CPU tier; the CPU tier's LRU victims move to the disk tier when there
is one (and leave the node otherwise); the disk tier's LRU victims leave the node. A read
refreshes a block's place in its tier's LRU order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from services.kvstore.tiers import Block, BlockKey, CPUTier, DiskTier


class Medium(str, Enum):
    CPU = "cpu"
    DISK = "disk"


@dataclass(slots=True, frozen=True)
class Change:
    key: BlockKey
    is_stored: bool          # False: removed from `medium`
    medium: Medium
    size: int = 0            # stored blocks: payload bytes and the writer's checksum
    checksum: int = 0
    is_refresh: bool = False  # stored again while held: its index entry is written anew


class BlockStore:
    def __init__(self, cpu_bytes: int, disk: DiskTier | None = None) -> None:
        self.cpu = CPUTier(cpu_bytes)
        self.disk = disk

    def medium_of(self, key: BlockKey) -> Medium | None:
        if key in self.cpu:
            return Medium.CPU
        if self.disk is not None and key in self.disk:
            return Medium.DISK
        return None

    def adopt_disk(self) -> list[tuple[BlockKey, int, int]]:
        """Blocks a previous run left in the disk tier: (key, size, checksum)."""
        return self.disk.adopt_existing() if self.disk is not None else []

    def put(self, key: BlockKey, block: Block) -> list[Change] | None:
        """Stores a block; None when it is larger than the CPU tier (refused). A block this node
        already holds is only refreshed (equal hashes under one fingerprint mean equal KV):
        its LRU place, and its index entry, which may have expired or been lost meanwhile."""
        if len(block.data) > self.cpu.capacity_bytes:
            return None
        medium = self.medium_of(key)
        if medium is not None:
            self.cpu.get(key)   # refreshes its LRU place if in memory
            return [Change(key, True, medium, len(block.data), block.checksum, is_refresh=True)]
        changes = [Change(key, True, Medium.CPU, len(block.data), block.checksum)]
        for old_key, old in self.cpu.put(key, block):
            changes.append(Change(old_key, False, Medium.CPU))
            if self.disk is not None:
                for gone in self.disk.put(old_key, old):
                    if gone != old_key:
                        changes.append(Change(gone, False, Medium.DISK))
                if old_key in self.disk:
                    changes.append(Change(old_key, True, Medium.DISK, len(old.data),
                                          old.checksum))
        return changes

    def get(self, key: BlockKey) -> Block | None:
        block = self.cpu.get(key)
        if block is None and self.disk is not None:
            block = self.disk.get(key)
        return block

    def lookup(self, fingerprint: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading hashes this node holds (in either tier)."""
        for count, block_hash in enumerate(block_hashes):
            if self.medium_of((fingerprint, block_hash)) is None:
                return count
        return len(block_hashes)

    def delete(self, keys: Sequence[BlockKey]) -> list[Change]:
        changes = []
        for key in keys:
            if self.cpu.pop(key) is not None:
                changes.append(Change(key, False, Medium.CPU))
            if self.disk is not None and self.disk.pop(key):
                changes.append(Change(key, False, Medium.DISK))
        return changes

    def keys_of(self, fingerprint: str) -> list[BlockKey]:
        keys = [k for k in self.cpu.keys() if k[0] == fingerprint]
        if self.disk is not None:
            keys += [k for k in self.disk.keys() if k[0] == fingerprint and k not in self.cpu]
        return keys

    def all_keys(self) -> list[tuple[BlockKey, Medium]]:
        keys = [(k, Medium.CPU) for k in self.cpu.keys()]
        if self.disk is not None:
            keys += [(k, Medium.DISK) for k in self.disk.keys()]
        return keys
