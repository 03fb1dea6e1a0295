"""Approximate mode, for when KV events are off (Dynamo's ApproxKvIndexer): a prefix index
fed by the router's own decisions.

After routing a request to engine E, the router records that E holds the prompt's blocks,
for `ttl_s`: engines evict, so past a while the guess is more often wrong than right.
Recording a block again renews it. Expiry is lazy (each call first drops what is due), and
as every entry lives the same TTL on a monotonic clock, entries fall due in the order they
were recorded: a FIFO queue, O(1) per entry, no timer.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from services.frontend.router.prefix_index import PrefixIndex


class ApproximateIndex:
    def __init__(self, ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._index = PrefixIndex()
        self._worker_to_expiry: dict[str, dict[bytes, float]] = {}
        self._due: deque[tuple[float, str, tuple[bytes, ...]]] = deque()

    @property
    def num_blocks(self) -> int:
        self._expire()
        return self._index.num_blocks

    def num_blocks_of(self, worker_id: str) -> int:
        self._expire()
        return len(self._worker_to_expiry.get(worker_id, ()))

    def record(self, worker_id: str, block_hashes: Sequence[bytes]) -> None:
        """The request with this prompt chain went to `worker_id`."""
        self._expire()
        expires = self._clock() + self._ttl_s
        hashes = tuple(block_hashes)
        self._index.store(worker_id, hashes)
        self._worker_to_expiry.setdefault(worker_id, {}).update(dict.fromkeys(hashes, expires))
        self._due.append((expires, worker_id, hashes))

    def overlaps(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """As PrefixIndex.overlaps, over the blocks recorded within the TTL."""
        self._expire()
        return self._index.overlaps(block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        self._index.remove_worker(worker_id)
        self._worker_to_expiry.pop(worker_id, None)

    def _expire(self) -> None:
        now = self._clock()
        while self._due and self._due[0][0] <= now:
            expires, worker_id, hashes = self._due.popleft()
            expiry = self._worker_to_expiry.get(worker_id, {})
            # A block recorded again since carries a later time: it stays.
            stale = [h for h in hashes if expiry.get(h) == expires]
            for block_hash in stale:
                del expiry[block_hash]
            self._index.remove(worker_id, stale)
