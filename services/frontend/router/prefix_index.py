"""The KV router's global prefix index: which workers hold which block, and in which medium.

Fed by KV events (services/common/kv_event_stream.py): a worker is a publisher, an engine's
scheduler (KV_MEDIUM_GPU: its pool, on an accelerator or in CPU memory) or a kvstore node
(KV_MEDIUM_CPU / _DISK: its tiers). Block hashes chain (services/common/block_hash.py): a
block's hash covers every token before it, so a worker holding block i of a prompt's chain
holds the prompt's first i + 1 blocks' KV, and the walk in `overlaps` only needs lookups.

Layout, for speed (Dynamo's radix tree, flattened: the chained hashes make the tree's
edges implicit): each worker is interned to a bit, and each medium has one dict
block hash -> bitmask of the workers holding it. `overlaps` is then one dict lookup and
two integer ops per block, and stops at the first block no worker still matching holds.
Each worker also keeps its own blocks per medium, so clearing it costs its own size.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from functools import partial

import betterproto

from services.common import wire

ENGINE_MEDIA: tuple[wire.KvMedium, ...] = (wire.KvMedium.GPU,)
"""What an engine can reuse without a transfer: its own pool."""


class PrefixIndex:
    def __init__(self) -> None:
        self._worker_to_bit: dict[str, int] = {}
        self._bit_to_worker: list[str | None] = []
        self._medium_to_masks: dict[int, dict[bytes, int]] = {}
        self._worker_to_blocks: dict[str, dict[int, set[bytes]]] = {}

    @property
    def num_blocks(self) -> int:
        """Index entries: distinct (block, medium) pairs held by at least one worker."""
        return sum(len(masks) for masks in self._medium_to_masks.values())

    def apply(self, worker_id: str, events: Iterable[wire.KvEvent]) -> None:
        """Applies one worker's events in order (a snapshot starts with `cleared`). A worker
        is known from its first batch, even one that says only that it holds nothing."""
        self._bit(worker_id)
        for event in events:
            kind, payload = betterproto.which_one_of(event, "event")
            if kind == "stored":
                self.store(worker_id, payload.block_hashes, payload.medium)
            elif kind == "removed":
                self.remove(worker_id, payload.block_hashes, payload.medium)
            elif kind == "cleared":
                self.clear_worker(worker_id)

    def store(self, worker_id: str, block_hashes: Iterable[bytes],
              medium: wire.KvMedium = wire.KvMedium.GPU) -> None:
        key = _normalized(medium)
        bit = self._bit(worker_id)
        masks = self._medium_to_masks.setdefault(key, {})
        held = self._worker_to_blocks[worker_id].setdefault(key, set())
        for block_hash in block_hashes:
            masks[block_hash] = masks.get(block_hash, 0) | bit
            held.add(block_hash)

    def blocks_of(self, worker_id: str,
                  medium: wire.KvMedium = wire.KvMedium.GPU) -> frozenset[bytes]:
        return frozenset(self._worker_to_blocks.get(worker_id, {}).get(_normalized(medium), ()))

    def num_blocks_of(self, worker_id: str) -> int:
        return sum(map(len, self._worker_to_blocks.get(worker_id, {}).values()))

    def knows(self, worker_id: str) -> bool:
        """Whether the worker has published (an empty pool included) and not left."""
        return worker_id in self._worker_to_bit

    def remove(self, worker_id: str, block_hashes: Iterable[bytes],
               medium: wire.KvMedium = wire.KvMedium.GPU) -> None:
        """Blocks the worker does not hold (an event replayed after a snapshot) are skipped."""
        key = _normalized(medium)
        held = self._worker_to_blocks.get(worker_id, {}).get(key)
        if not held:
            return
        present = held.intersection(block_hashes)
        held.difference_update(present)
        self._drop_bit(self._worker_to_bit[worker_id], self._medium_to_masks[key], present)

    def clear_worker(self, worker_id: str) -> None:
        """Drops every block of the worker; it keeps its bit (it is still publishing)."""
        bit = self._worker_to_bit.get(worker_id)
        if bit is None:
            return
        for medium, held in self._worker_to_blocks[worker_id].items():
            self._drop_bit(bit, self._medium_to_masks[medium], held)
            held.clear()

    def remove_worker(self, worker_id: str) -> None:
        """Forgets the worker (it left); its bit goes to the next new worker."""
        self.clear_worker(worker_id)
        bit = self._worker_to_bit.pop(worker_id, None)
        if bit is not None:
            del self._worker_to_blocks[worker_id]
            self._bit_to_worker[bit.bit_length() - 1] = None

    def overlaps(self, block_hashes: Sequence[bytes],
                 media: Collection[wire.KvMedium] = ENGINE_MEDIA) -> dict[str, int]:
        """Worker -> how many leading blocks of the chain it holds in any of `media`; only
        workers holding at least the first block appear."""
        tables = [self._medium_to_masks[m] for m in map(_normalized, media)
                  if m in self._medium_to_masks]
        worker_to_depth: dict[str, int] = {}
        if not block_hashes:
            return worker_to_depth
        # NOTE: one medium (every engine lookup) walks with the dict's own get: the hot path.
        get = tables[0].get if len(tables) == 1 else partial(_held_in_any, tables)
        matching, depth = get(block_hashes[0], 0), 1
        while matching and depth < len(block_hashes):
            held = get(block_hashes[depth], 0)
            if matching & ~held:
                self._set_depth(worker_to_depth, matching & ~held, depth)
                matching &= held
            depth += 1
        self._set_depth(worker_to_depth, matching, depth)
        return worker_to_depth

    def _set_depth(self, worker_to_depth: dict[str, int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            worker_id = self._bit_to_worker[low.bit_length() - 1]
            assert worker_id is not None   # a bit in a mask belongs to a live worker
            worker_to_depth[worker_id] = depth
            mask ^= low

    def _bit(self, worker_id: str) -> int:
        bit = self._worker_to_bit.get(worker_id)
        if bit is not None:
            return bit
        if None in self._bit_to_worker:   # a departed worker's bit: masks stay narrow
            index = self._bit_to_worker.index(None)
            self._bit_to_worker[index] = worker_id
        else:
            index = len(self._bit_to_worker)
            self._bit_to_worker.append(worker_id)
        self._worker_to_blocks[worker_id] = {}
        bit = self._worker_to_bit[worker_id] = 1 << index
        return bit

    @staticmethod
    def _drop_bit(bit: int, masks: dict[bytes, int], block_hashes: Iterable[bytes]) -> None:
        for block_hash in block_hashes:
            mask = masks[block_hash] & ~bit
            if mask:
                masks[block_hash] = mask
            else:
                del masks[block_hash]


def _normalized(medium: int) -> int:
    # NOTE: as in vLLM's schema, an event without a medium is about the engine's own pool.
    return int(wire.KvMedium.GPU if medium == wire.KvMedium.UNSPECIFIED else medium)


def _held_in_any(tables: list[dict[bytes, int]], block_hash: bytes, mask: int) -> int:
    """The workers holding the block in any table, ORed into `mask` (dict.get's shape)."""
    for table in tables:
        mask |= table.get(block_hash, 0)
    return mask
