"""The worker's state checkpoint slots, as the scheduler sees them (hybrid models only).

A hybrid model's Mamba layers hold one recurrent state per sequence, not KV per token, so a
cached attention prefix is of use only where a copy of the state at exactly its end was kept
(vLLM's mamba "align" cache mode). The worker holds `num_slots` such copies; this pool says
which slot holds the state after which block, keyed by that block's hash (the hash of the
whole prefix ending there), and hands slots out for new copies.

A slot is free, pinned (a running request's latest checkpoint past its prompt, replaced
by the next one it takes: one per request while it runs) or evictable (least recently
used first). A pinned slot whose block hash is not known yet (async scheduling saves the
state before the token that ends the block is back) is named when its request is freed.

No slot needs to stay pinned while a step restores from it: the worker restores a step's
rows before its forward pass and saves after it, and runs steps in order, so a slot reused
for a save in this step or a later one is read first.
"""

from __future__ import annotations

from collections import OrderedDict

from services.common.block_hash import BlockHash
from services.scheduler.core.request import Request


class StateCheckpointPool:
    def __init__(self, num_slots: int, block_size: int) -> None:
        self.num_slots = num_slots
        self.block_size = block_size
        self._free = list(range(num_slots - 1, -1, -1))
        self._hash_to_slot: dict[BlockHash, int] = {}
        self._slot_to_hash: dict[int, BlockHash] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()   # oldest use first
        self._req_to_latest: dict[str, tuple[int, int]] = {}      # id -> (slot, tokens)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The slot holding the state after the block of `block_hash`, marked as used."""
        slot = self._hash_to_slot.get(block_hash)
        if slot is not None and slot in self._evictable:
            self._evictable.move_to_end(slot)
        return slot

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hash_to_slot

    def take(self, request: Request, num_tokens: int) -> int | None:
        """A slot for the request's state after its first `num_tokens` tokens (a block
        boundary), or None: that state is kept already, or every slot is pinned. A
        checkpoint past the prompt replaces the request's previous one."""
        block_hash = self._hash_at(request, num_tokens)
        if block_hash is not None and block_hash in self._hash_to_slot:
            return None
        is_latest = num_tokens > request.num_prompt_tokens
        if is_latest:
            self._drop_latest(request.request_id)
        slot = self._allocate()
        if slot is None:
            return None
        if is_latest:
            self._req_to_latest[request.request_id] = (slot, num_tokens)
            if block_hash is not None:
                self._name(slot, block_hash)
        else:
            self._name(slot, block_hash)   # a prompt's blocks are hashed: never None here
            self._evictable[slot] = None
        return slot

    def release(self, request: Request) -> None:
        """The request left the running batch: its latest checkpoint stays cached (what
        the next chat turn will hit), named now if its last token was a placeholder."""
        latest = self._req_to_latest.pop(request.request_id, None)
        if latest is None:
            return
        slot, num_tokens = latest
        if slot not in self._slot_to_hash:
            block_hash = self._hash_at(request, num_tokens)
            if block_hash is None or block_hash in self._hash_to_slot:
                self._free.append(slot)
                return
            self._name(slot, block_hash)
        self._evictable[slot] = None

    def reset(self) -> None:
        """Forgets every evictable checkpoint (the prefix cache is dropped)."""
        for slot in self._evictable:
            del self._hash_to_slot[self._slot_to_hash.pop(slot)]
            self._free.append(slot)
        self._evictable.clear()

    @property
    def num_free_slots(self) -> int:
        """Free or evictable."""
        return len(self._free) + len(self._evictable)

    def _hash_at(self, request: Request, num_tokens: int) -> BlockHash | None:
        index = num_tokens // self.block_size - 1
        return request.block_hashes[index] if index < len(request.block_hashes) else None

    def _name(self, slot: int, block_hash: BlockHash) -> None:
        self._hash_to_slot[block_hash] = slot
        self._slot_to_hash[slot] = block_hash

    def _allocate(self) -> int | None:
        if self._free:
            return self._free.pop()
        if not self._evictable:
            return None
        slot, _ = self._evictable.popitem(last=False)
        del self._hash_to_slot[self._slot_to_hash.pop(slot)]
        return slot

    def _drop_latest(self, request_id: str) -> None:
        latest = self._req_to_latest.pop(request_id, None)
        if latest is None:
            return
        slot = latest[0]
        block_hash = self._slot_to_hash.pop(slot, None)
        if block_hash is not None:
            del self._hash_to_slot[block_hash]
        self._free.append(slot)
