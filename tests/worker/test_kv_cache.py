"""KV cache sizing: bytes per token, the budget, and refusing a budget too small."""

from __future__ import annotations

import pytest
import torch

from services.worker.kv.kv_cache import (
    KVCacheSpec,
    KVCacheTooSmallError,
    accelerator_kv_budget,
    allocate_kv_caches,
    explicit_accelerator_kv_budget,
    kv_cache_dtype,
    num_blocks_for_budget,
)

# SmolLM2-135M: 30 layers, 3 KV heads of 64.
SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16)


def test_bytes_per_token_follow_the_formula_and_fp8_halves_16_bit() -> None:
    fp32 = KVCacheSpec(**SMOLLM2, dtype=torch.float32)
    bf16 = KVCacheSpec(**SMOLLM2, dtype=kv_cache_dtype("auto", torch.bfloat16))
    fp8 = KVCacheSpec(**SMOLLM2, dtype=kv_cache_dtype("fp8", torch.bfloat16))
    assert fp32.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080
    assert bf16.bytes_per_token == fp32.bytes_per_token // 2
    assert fp8.bytes_per_token == bf16.bytes_per_token // 2
    assert fp8.bytes_per_block == 16 * fp8.bytes_per_token


def test_budget_gives_whole_blocks() -> None:
    spec = KVCacheSpec(**SMOLLM2, dtype=torch.float32)
    budget = 100 * spec.bytes_per_block + 123
    assert num_blocks_for_budget(spec, budget, 1024, 256, is_default_budget=False) == 100


def test_default_budget_is_capped_at_what_max_num_seqs_can_use() -> None:
    spec = KVCacheSpec(**SMOLLM2, dtype=torch.float32)
    blocks = num_blocks_for_budget(spec, 10**12, max_model_len=100, max_num_seqs=4,
                                   is_default_budget=True)
    assert blocks == 4 * 7 + 1  # 7 blocks per 100-token request, plus the null block
    assert num_blocks_for_budget(spec, 10**10, 100, 4, is_default_budget=False) > blocks


def test_refuses_a_budget_below_one_max_length_request_with_what_to_do() -> None:
    spec = KVCacheSpec(**SMOLLM2, dtype=torch.float32)
    budget = 64 * spec.bytes_per_block  # 63 usable blocks = 1008 tokens
    assert num_blocks_for_budget(spec, budget, 1008, 8, False) == 64
    with pytest.raises(KVCacheTooSmallError) as err:
        num_blocks_for_budget(spec, budget, 1009, 8, False)
    assert isinstance(err.value, ValueError)
    message = str(err.value)
    assert "--kv-cache-memory" in message and "--max-model-len" in message
    assert "1008 tokens" in message and "46080 bytes per token" in message


def test_accelerator_budget_subtracts_others_and_our_peak() -> None:
    gib = 2**30
    assert accelerator_kv_budget(0.9, 80 * gib, 2 * gib, 10 * gib) == int(0.9 * 80 * gib) - 12 * gib


def test_explicit_accelerator_budget_is_exact_when_it_fits_and_refused_when_not() -> None:
    gib = 2**30
    available = accelerator_kv_budget(0.9, 80 * gib, 2 * gib, 10 * gib)
    assert explicit_accelerator_kv_budget(8 * gib, available, 0.9) == 8 * gib
    with pytest.raises(KVCacheTooSmallError) as err:
        explicit_accelerator_kv_budget(70 * gib, available, 0.9)
    message = str(err.value)
    assert "70.00 GiB" in message and f"{available / gib:.2f} GiB" in message
    assert "--gpu-memory-utilization 0.9" in message


def test_allocated_caches_are_zeroed_views_of_one_region() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4,
                       dtype=torch.float8_e4m3fn)
    caches = allocate_kv_caches(spec, 5, torch.device("cpu"))
    assert len(caches) == 3 and all(c.is_fp8 for c in caches)
    assert caches[0].key.shape == (5, 4, 2, 8)
    storages = {c.untyped_storage().data_ptr() for cache in caches
                for c in (cache.key, cache.value)}
    assert len(storages) == 1
    assert not caches[1].value.float().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_caches_are_aligned_writable_zeros_in_every_dtype(dtype: torch.dtype) -> None:
    # Lazily zeroed pages (not written up front): still zeros, 64-byte aligned, writable.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    caches = allocate_kv_caches(spec, 7, torch.device("cpu"))
    assert all(c.key.dtype == dtype and c.key.shape == (7, 4, 2, 8) for c in caches)
    assert caches[0].key.data_ptr() % 64 == 0
    assert not any(t.float().any() for c in caches for t in (c.key, c.value))
    caches[1].value[3].fill_(1.0)
    assert caches[1].value.float().sum() == 4 * 2 * 8 and not caches[1].key.float().any()


def _thp_mode() -> str:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "absent"
    return text[text.index("[") + 1:text.index("]")]


def _huge_page_kib_within(low: int, high: int) -> int:
    """AnonHugePages (KiB) of this process's mappings overlapping [low, high)."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = start < high and low < end
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1])
    return total


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"),
                    reason="this kernel offers no transparent huge pages")
def test_cpu_cache_is_backed_by_huge_pages_once_written() -> None:
    # In this long-lived process (hundreds of tests in), whatever its heap holds: the cache
    # is a mapping of its own.
    spec = KVCacheSpec(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16)
    caches = allocate_kv_caches(spec, 160, torch.device("cpu"))   # ~59 MiB
    for cache in caches:
        cache.key.fill_(1.0)
        cache.value.fill_(1.0)
    low = caches[0].key.data_ptr()
    high = caches[-1].value.data_ptr() + caches[-1].value.nbytes
    assert _huge_page_kib_within(low, high) >= 4096
