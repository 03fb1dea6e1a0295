"""KV cache sizing and allocation: how many blocks fit in the memory budget, and the tensors.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element; an fp8 cache
(float8_e4m3fn) stores one byte per element plus two fp32 scales per layer (1.0: values are
stored unscaled, saturated at +-448, as vLLM does without calibrated scales), halving a 16-bit
cache. Block 0 is the null block: allocated, never handed out by the scheduler.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import structlog
import torch

from services.worker.attention.backend import KVCache
from services.worker.kv.kv_prefault import prefault_in_background, release_pages

log = structlog.get_logger(__name__)

KV_CACHE_DTYPES = ("auto", "fp8")
NUM_NULL_BLOCKS = 1


class KVCacheTooSmallError(ValueError):
    """The KV budget cannot hold one request of max_model_len tokens."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size


def kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r} (choose from "
                     f"{', '.join(KV_CACHE_DTYPES)})")


def num_blocks_for_budget(spec: KVCacheSpec, budget_bytes: int, max_model_len: int,
                          max_num_seqs: int, is_default_budget: bool,
                          shared_bytes_per_block: int = 0) -> int:
    """Blocks (null block included) that fit in budget_bytes; refuses a budget too small.

    A default budget (a fraction of RAM) is capped at what max_num_seqs requests of
    max_model_len tokens could ever use; an explicit one is taken as given.
    shared_bytes_per_block: what another cache indexed by the same block ids (a draft
    model's) takes per block out of the same budget.
    """
    blocks_per_request = math.ceil(max_model_len / spec.block_size)
    bytes_per_block = spec.bytes_per_block + shared_bytes_per_block
    num_blocks = budget_bytes // bytes_per_block
    if is_default_budget:
        num_blocks = min(num_blocks, max_num_seqs * blocks_per_request + NUM_NULL_BLOCKS)
    if num_blocks - NUM_NULL_BLOCKS < blocks_per_request:
        needed = (blocks_per_request + NUM_NULL_BLOCKS) * bytes_per_block
        raise KVCacheTooSmallError(
            f"the KV cache budget ({_gib(budget_bytes)}) holds "
            f"{max(num_blocks - NUM_NULL_BLOCKS, 0) * spec.block_size} tokens, fewer than one "
            f"request of max_model_len={max_model_len} tokens needs ({_gib(needed)} at "
            f"{bytes_per_block // spec.block_size} bytes per token): raise --kv-cache-memory (or "
            f"--gpu-memory-utilization), lower --max-model-len, or use --kv-cache-dtype fp8")
    return int(num_blocks)


def _lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in its own anonymous mapping, whose pages the kernel zeroes on first
    touch, on transparent huge pages where the kernel offers them (kv_prefault.py faults them
    in ahead of use).
    NOTE: torch.zeros writes every page up front: 7 s for the default 5 GiB cache on a busy
    2-core machine, at every worker (re)start. Not from the heap either (numpy, calloc): a
    long-lived process's allocator may serve it from already-touched 4 KiB pages, and decode
    attention, reading blocks of a few KiB scattered over the cache, is 0-10% slower there
    (benchmarks/decode_attention.py --pages)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    region = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):   # Linux; page-aligned, so vector loads are aligned
        region.madvise(mmap.MADV_HUGEPAGE)
    # NOTE: the tensor holds a reference to the mapping, which lives as long as it does.
    return torch.frombuffer(region, dtype=torch.uint8, count=num_bytes).view(dtype).view(shape)


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int,
                       device: torch.device) -> list[KVCache]:
    """One [num_blocks, block_size, kv_heads, head_dim] key and value tensor per layer.

    NOTE: zero-filled, not empty: attention reads whole blocks, and never-written slots of a
    block must hold finite values (masked NaN garbage would still poison the softmax).
    One allocation for all layers, so the cache is one region the allocator never splits.
    """
    shape = (spec.num_layers, 2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    if device.type == "cpu":
        storage = _lazily_zeroed(shape, spec.dtype)
        prefault_in_background(storage, num_regions=spec.num_layers * 2)
    else:
        storage = torch.zeros(shape, dtype=spec.dtype, device=device)
    scales = torch.ones(spec.num_layers, 2, dtype=torch.float32, device=device)
    return [KVCache(key=storage[i, 0], value=storage[i, 1],
                    k_scale_tensor=scales[i, 0:1], v_scale_tensor=scales[i, 1:2])
            for i in range(spec.num_layers)]


def release_kv_caches(kv_caches: list[KVCache]) -> None:
    """Sleep mode: gives the cache's memory back; its contents are lost. The tensors stay
    (the model and the KV connector hold views of them): on CPU the kernel takes their pages,
    on an accelerator their storage shrinks to nothing until restore_kv_caches()."""
    storage = kv_caches[0].key.untyped_storage()   # one storage for every layer
    if storage.device.type == "cpu":
        release_pages(storage)
    else:
        storage.resize_(0)
        torch.cuda.empty_cache()


def restore_kv_caches(kv_caches: list[KVCache], spec: KVCacheSpec, num_blocks: int) -> None:
    """Memory for a released cache again, zero-filled (allocate_kv_caches says why)."""
    storage = kv_caches[0].key.untyped_storage()
    if storage.device.type == "cpu":
        return   # its pages come back zeroed as they are touched
    storage.resize_(num_blocks * spec.bytes_per_block)
    for cache in kv_caches:
        cache.key.zero_()
        cache.value.zero_()


def accelerator_kv_budget(gpu_memory_utilization: float, total_bytes: int,
                          used_by_others_bytes: int, peak_bytes: int) -> int:
    """vLLM's rule: utilization x total, minus what other processes held before we loaded and
    our own peak (weights + activations of a forward pass at the maximum batch)."""
    return int(gpu_memory_utilization * total_bytes) - used_by_others_bytes - peak_bytes


def explicit_accelerator_kv_budget(requested_bytes: int, available_bytes: int,
                                   gpu_memory_utilization: float) -> int:
    """--kv-cache-memory on an accelerator: exactly that much, as vLLM's
    --kv-cache-memory-bytes (utilization then only bounds it), if it fits beside the weights
    and activations."""
    if requested_bytes > available_bytes:
        raise KVCacheTooSmallError(
            f"--kv-cache-memory asks for {requested_bytes / 2**30:.2f} GiB of KV cache but only "
            f"{max(available_bytes, 0) / 2**30:.2f} GiB is left on the device within "
            f"--gpu-memory-utilization {gpu_memory_utilization} (after other processes, the "
            "weights and peak activations): lower --kv-cache-memory or raise the utilization")
    return requested_bytes


@dataclass(frozen=True)
class RecurrentStateSize:
    """A hybrid's recurrent states beside its KV (runner/hybrid_states.py): a slot per running
    sequence, and checkpoint slots that keep copies for prefix caching."""
    num_slots: int
    num_checkpoints: int
    bytes_per_seq: int          # one sequence's state in every Mamba layer

    @property
    def num_bytes(self) -> int:
        return (self.num_slots + self.num_checkpoints) * self.bytes_per_seq


def log_kv_cache_size(spec: KVCacheSpec, num_blocks: int, max_model_len: int,
                      states: RecurrentStateSize | None = None) -> None:
    """vLLM's start-up line: the cache in tokens and the requests of max_model_len it holds at
    once. A hybrid's running request also takes a state slot, so its concurrency is the smaller
    of the two bounds, and the states' memory is said beside the KV's."""
    num_tokens = (num_blocks - NUM_NULL_BLOCKS) * spec.block_size
    max_concurrency = num_tokens / max_model_len
    hybrid = {}
    if states is not None:
        hybrid = dict(state_slots=states.num_slots, state_checkpoints=states.num_checkpoints,
                      state_bytes_per_seq=states.bytes_per_seq,
                      state_gib=round(states.num_bytes / 2**30, 3),
                      kv_max_concurrency=round(max_concurrency, 2))
        max_concurrency = min(max_concurrency, states.num_slots)
    log.info("KV cache sized", num_blocks=num_blocks, block_size=spec.block_size,
             kv_cache_tokens=num_tokens, bytes_per_token=spec.bytes_per_token,
             kv_cache_gib=round(num_blocks * spec.bytes_per_block / 2**30, 3),
             dtype=str(spec.dtype).removeprefix("torch."),
             max_concurrency=round(max_concurrency, 2), max_model_len=max_model_len, **hybrid)


def available_cpu_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes): what can be allocated without swapping."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("MemAvailable not found in /proc/meminfo")


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
