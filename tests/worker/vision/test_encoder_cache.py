"""EncoderCache: hits and misses counted, least recently used evicted, bounded by rows."""

from __future__ import annotations

import pytest
import torch

from services.worker.models.vision.encoder_cache import EncoderCache


def rows(n: int) -> torch.Tensor:
    return torch.randn(n, 8)


def test_hit_returns_the_cached_embeddings_and_counts() -> None:
    cache = EncoderCache(max_num_tokens=10)
    assert cache.get("a") is None
    embeddings = rows(4)
    assert cache.put("a", embeddings)
    assert cache.get("a") is embeddings
    assert (cache.num_hits, cache.num_misses, cache.num_tokens, len(cache)) == (1, 1, 4, 1)


def test_least_recently_used_is_evicted_first() -> None:
    cache = EncoderCache(max_num_tokens=10)
    cache.put("a", rows(4))
    cache.put("b", rows(4))
    cache.get("a")                      # b is now the least recently used
    cache.put("c", rows(4))
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.num_evictions == 1 and cache.num_tokens == 8


def test_evicts_as_many_as_needed_and_never_exceeds_the_bound() -> None:
    cache = EncoderCache(max_num_tokens=10)
    for key in "abcde":
        cache.put(key, rows(2))
    assert cache.put("big", rows(9))
    assert list(k for k in "abcde" if k in cache) == [] and cache.num_tokens == 9
    assert cache.num_evictions == 5


def test_too_large_is_not_cached_and_evicts_nothing() -> None:
    cache = EncoderCache(max_num_tokens=10)
    cache.put("a", rows(3))
    assert not cache.put("huge", rows(11))
    assert "huge" not in cache and "a" in cache and cache.num_evictions == 0


def test_put_again_replaces_without_double_counting() -> None:
    cache = EncoderCache(max_num_tokens=10)
    cache.put("a", rows(6))
    cache.put("a", rows(3))
    assert cache.num_tokens == 3 and len(cache) == 1 and cache.num_evictions == 0


def test_contains_neither_counts_nor_touches() -> None:
    cache = EncoderCache(max_num_tokens=4)
    cache.put("a", rows(2))
    cache.put("b", rows(2))
    assert "a" in cache
    cache.put("c", rows(2))             # "a" is still the least recently used
    assert "a" not in cache
    assert cache.num_hits == cache.num_misses == 0


def test_rejects_a_non_positive_bound() -> None:
    with pytest.raises(ValueError):
        EncoderCache(max_num_tokens=0)
