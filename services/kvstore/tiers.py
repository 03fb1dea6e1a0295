"""The kvstore's two tiers, each bounded in bytes with LRU eviction: CPU memory and an
optional directory on disk. A block is (fingerprint, hash) -> payload + writer's checksum.

Accounting counts payload bytes; a tier never holds more than its capacity after any call.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

BlockKey = tuple[str, bytes]   # (model fingerprint, block hash)
_CHECKSUM_BYTES = 8


@dataclass(slots=True)
class Block:
    data: bytes
    checksum: int


class CPUTier:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blocks: OrderedDict[BlockKey, Block] = OrderedDict()   # LRU first

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> list[BlockKey]:
        return list(self._blocks)

    def get(self, key: BlockKey) -> Block | None:
        block = self._blocks.get(key)
        if block is not None:
            self._blocks.move_to_end(key)
        return block

    def put(self, key: BlockKey, block: Block) -> list[tuple[BlockKey, Block]]:
        """Stores the block (most recently used) and returns the blocks evicted to make room.
        A block larger than the whole tier is not stored (and returned as evicted)."""
        self.pop(key)
        if len(block.data) > self.capacity_bytes:
            return [(key, block)]
        evicted = []
        while self.used_bytes + len(block.data) > self.capacity_bytes:
            old_key, old = self._blocks.popitem(last=False)
            self.used_bytes -= len(old.data)
            evicted.append((old_key, old))
        self._blocks[key] = block
        self.used_bytes += len(block.data)
        return evicted

    def pop(self, key: BlockKey) -> Block | None:
        block = self._blocks.pop(key, None)
        if block is not None:
            self.used_bytes -= len(block.data)
        return block


class DiskTier:
    """One file per block: <dir>/<fingerprint>/<hash hex>, holding the checksum (8 bytes, little
    endian) then the payload. Files are written to a temporary name and renamed, so a crash
    never leaves a truncated block under a real name. Blocks found at start are adopted
    (oldest first evicted), so a restarted node keeps its disk tier."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._sizes: OrderedDict[BlockKey, int] = OrderedDict()   # LRU first
        directory.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def keys(self) -> list[BlockKey]:
        return list(self._sizes)

    def adopt_existing(self) -> list[tuple[BlockKey, int, int]]:
        """Takes in the blocks already on disk, oldest evicted first beyond capacity; returns
        (key, size, checksum) of each block kept."""
        found = []
        for path in self.directory.glob("*/*"):
            if path.suffix == ".tmp":   # a write cut short by a crash
                path.unlink(missing_ok=True)
                continue
            stat = path.stat()
            found.append((stat.st_mtime, path, stat.st_size - _CHECKSUM_BYTES))
        checksums: dict[BlockKey, int] = {}
        for _, path, size in sorted(found):
            key = (path.parent.name, bytes.fromhex(path.name))
            with open(path, "rb") as f:
                checksums[key] = int.from_bytes(f.read(_CHECKSUM_BYTES), "little")
            self._make_room(size)
            self._sizes[key] = size
            self.used_bytes += size
        return [(key, size, checksums[key]) for key, size in self._sizes.items()]

    def get(self, key: BlockKey) -> Block | None:
        if key not in self._sizes:
            return None
        try:
            raw = self._path(key).read_bytes()
        except OSError:
            self.pop(key)
            return None
        self._sizes.move_to_end(key)
        return Block(raw[_CHECKSUM_BYTES:], int.from_bytes(raw[:_CHECKSUM_BYTES], "little"))

    def put(self, key: BlockKey, block: Block) -> list[BlockKey]:
        """Writes the block; returns the keys evicted to make room (the block itself if it
        is larger than the tier)."""
        self.pop(key)
        size = len(block.data)
        if size > self.capacity_bytes:
            return [key]
        evicted = self._make_room(size)
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        temporary = path.with_suffix(".tmp")
        with open(temporary, "wb") as f:
            f.write(block.checksum.to_bytes(_CHECKSUM_BYTES, "little"))
            f.write(block.data)
        os.replace(temporary, path)
        self._sizes[key] = size
        self.used_bytes += size
        return evicted

    def pop(self, key: BlockKey) -> bool:
        size = self._sizes.pop(key, None)
        if size is None:
            return False
        self.used_bytes -= size
        self._path(key).unlink(missing_ok=True)
        return True

    def _make_room(self, size: int) -> list[BlockKey]:
        evicted = []
        while self._sizes and self.used_bytes + size > self.capacity_bytes:
            old_key, _ = next(iter(self._sizes.items()))
            self.pop(old_key)
            evicted.append(old_key)
        return evicted

    def _path(self, key: BlockKey) -> Path:
        fingerprint, block_hash = key
        return self.directory / fingerprint / block_hash.hex()
