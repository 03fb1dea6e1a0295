"""Triton building blocks shared by the paged attention kernels.

- `load_kv_tile`: gather BLOCK_N consecutive token positions of one KV head through a block
  table, dequantized and cast to the dtype the dots run in.
- `attend_tile`: one step of the online softmax (flash attention) over such a tile.
- host helpers: dtype checks, fp8 scale pointers, tile sizes.

Scores live in the log2 domain (qk_scale already holds log2(e)), so kernels use exp2 and
partial log-sum-exps are base 2 as well. A soft-cap c on natural-log scores is the cap
c * log2(e) on these (c tanh(s / c) scales linearly), so kernels take it pre-multiplied.
"""

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_WINDOW = 2**30  # a sliding window no context reaches (kernel arithmetic stays in int32)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def load_kv_tile(
    cache_ptr,
    block_table_row_ptr,
    offs_n,
    mask_n,
    kv_head,
    offs_d,
    mask_d,
    scale,
    stride_block,
    stride_offset,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    COMPUTE_DTYPE: tl.constexpr,
):
    """Returns cache[pos, kv_head, :] for positions offs_n as [BLOCK_N, BLOCK_D]; masked = 0."""
    # NOTE: masked lanes get block 0 (other=0) and their K/V loads are masked as well; every
    # load is masked because an out-of-bounds one kills the interpreter process.
    physical_block = tl.load(block_table_row_ptr + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
    row = physical_block.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_offset
    ptrs = cache_ptr + row[:, None] + kv_head * stride_head + offs_d[None, :]
    tile = tl.load(ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0)
    if IS_FP8:
        tile = tile.to(tl.float32) * scale
    return tile.to(COMPUTE_DTYPE)


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, SOFT_CAP: tl.constexpr = 0.0):
    """Online-softmax update of (m_i, l_i, acc) with one key/value tile.

    q [M, D], k/v [N, D] in the compute dtype; visible [M, N]; m_i/l_i [M] and acc [M, D] fp32.
    SOFT_CAP > 0: scores become SOFT_CAP * tanh(scores / SOFT_CAP) (log2 domain, see above).
    """
    if q.dtype == tl.float32:
        # NOTE: "ieee" keeps fp32 inputs exact on GPUs (the default would be tf32).
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if SOFT_CAP > 0.0:
        # NOTE: tanh(x) = 1 - 2 / (e^2x + 1) (e^2x = 2^(2 log2(e) x)): triton has no portable
        # tanh; e^2x saturates to inf / 0 at the ends, which gives +-1 exactly.
        s = SOFT_CAP * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / SOFT_CAP)) + 1.0))
    s = tl.where(visible, s, float("-inf"))
    # m_i starts at a finite floor, so a fully masked row gives exp2(-inf) = 0, never NaN.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if q.dtype == tl.float32:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


def compute_dtype(query: torch.Tensor) -> tl.dtype:
    """The dtype tiles are multiplied in: fp32 on CPU, the query's own dtype on a GPU.

    NOTE: the interpreter (CPU) gives garbage for tl.dot on bf16, so it always upcasts; on a GPU,
    fp16/bf16 dots with fp32 accumulation are the fast tensor-core path.
    """
    if query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported query dtype {query.dtype}")
    if query.device.type == "cpu" or query.dtype == torch.float32:
        return tl.float32
    return tl.float16 if query.dtype == torch.float16 else tl.bfloat16


def check_kv_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Validates the cache pair and returns whether it is fp8 (e4m3)."""
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must share shape and dtype")
    if key_cache.dim() != 4:
        raise ValueError("KV cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV cache head_dim must be contiguous")
    if key_cache.dtype == torch.float8_e4m3fn:
        return True
    if key_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported KV cache dtype {key_cache.dtype}")
    return False


def scale_arg(
    scale: float | torch.Tensor | None, is_fp8: bool, dummy: torch.Tensor
) -> torch.Tensor:
    """The pointer a kernel reads a per-tensor fp8 scale from (None = 1.0).

    Kernels read scales through a pointer so a tensor scale costs no host sync. Pass tensors
    when capturing CUDA graphs: a float becomes a cached device tensor on first use, and that
    first use must not happen during a capture. Without fp8 the kernel never reads it.
    """
    if not is_fp8:
        return dummy
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(device=dummy.device, dtype=torch.float32)
    return _cached_scale(1.0 if scale is None else float(scale), dummy.device)


@functools.lru_cache(maxsize=64)
def _cached_scale(value: float, device: torch.device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.float32, device=device)


def output_buffer(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """`out` after checking it can hold the result, or a new tensor like query."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError("out must match query in shape and dtype, head_dim contiguous")
    return out


def soft_cap_arg(logits_soft_cap: float | None) -> float:
    """The SOFT_CAP constexpr of attend_tile for a natural-log cap (None: 0.0, no capping)."""
    return 0.0 if logits_soft_cap is None else float(logits_soft_cap) * LOG2E


def window_arg(sliding_window: int | None) -> int:
    """A kernel's window argument: None reads as a window longer than any context."""
    return NO_WINDOW if sliding_window is None else int(sliding_window)


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))
