"""Image embeddings the worker already computed, so a repeated image is not encoded again."""

from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    """Embeddings [num_tokens, hidden] by the image's content hash, at most `max_num_tokens`
    embedding rows in all.

    Eviction order: least recently used first (a get or a put makes an entry the most recent).
    An entry larger than the whole cache is not kept. The counters (num_hits, num_misses,
    num_evictions) count get() calls and evicted entries since start.

    NOTE: bounded by rows, not entries: one high-resolution image can be thousands of tokens,
    a thumbnail tens, and the memory is the rows.
    """

    def __init__(self, max_num_tokens: int):
        if max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be positive, got {max_num_tokens}")
        self.max_num_tokens = max_num_tokens
        self.num_tokens = 0
        self.num_hits = 0
        self.num_misses = 0
        self.num_evictions = 0
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        """Whether `key` is cached (neither counted nor touched)."""
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embeddings (now the most recent), or None; counted as a hit or a miss."""
        embeddings = self._entries.get(key)
        if embeddings is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return embeddings

    def put(self, key: str, embeddings: torch.Tensor) -> bool:
        """Caches `embeddings` under `key` (replacing what was there), evicting the least
        recently used entries until it fits. Returns False where it is larger than the cache."""
        num_tokens = embeddings.shape[0]
        if num_tokens > self.max_num_tokens:
            return False
        self._remove(key)
        while self.num_tokens + num_tokens > self.max_num_tokens:
            self._remove(next(iter(self._entries)))
            self.num_evictions += 1
        self._entries[key] = embeddings
        self.num_tokens += num_tokens
        return True

    def _remove(self, key: str) -> None:
        embeddings = self._entries.pop(key, None)
        if embeddings is not None:
            self.num_tokens -= embeddings.shape[0]
