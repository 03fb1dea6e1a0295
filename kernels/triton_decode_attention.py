"""Paged decode attention: one query token per sequence, all query heads of a KV head together.

Program (seq b, kv head h, split s) holds the GROUP query heads that read kv head h as the rows
of one [BLOCK_G, D] tile (padded to >= 16 rows with masks, as GPU dots require), so every K/V
tile is loaded once for the whole group. With num_kv_splits > 1 each split covers a slice of the
context and writes its output over that slice plus the slice's log-sum-exp; a second kernel
merges the splits, weighting each by exp(lse). Splitting keeps the GPU busy when batch x kv
heads is smaller than the SM count and the contexts are long (the flash-decoding idea). With a
sliding window the splits cut only the keys inside it (the last `window` positions).
"""

import functools

import torch
import triton
import triton.language as tl

from kernels.launch_device import launch_device
from kernels.triton_paged_kv import (
    LOG2E,
    attend_tile,
    check_kv_cache,
    compute_dtype,
    load_kv_tile,
    next_pow2,
    output_buffer,
    scale_arg,
    soft_cap_arg,
    window_arg,
)

BLOCK_N = 64  # keys per tile
MAX_KV_SPLITS = 16
MIN_TOKENS_PER_SPLIT = 256  # shorter slices cost more in the reduce than they win
DEFAULT_SM_COUNT_CPU = 1  # the interpreter runs programs one by one: splitting never pays


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, k_scale_ptr, v_scale_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale, window,
    stride_qb, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    num_q_heads,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, IS_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q_ptrs = q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(COMPUTE_DTYPE)

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    # This split's slice of the visible keys, rounded to whole tiles (may be empty).
    kv_first = tl.maximum(seq_len - window, 0)
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len - kv_first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_start = kv_first + split * tokens_per_split
    kv_end = tl.minimum(kv_start + tokens_per_split, seq_len)

    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_start, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        k = load_kv_tile(k_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, mask_d, k_scale,
                         stride_kb, stride_ko, stride_kh, BLOCK_SIZE, IS_FP8, COMPUTE_DTYPE)
        v = load_kv_tile(v_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, mask_d, v_scale,
                         stride_vb, stride_vo, stride_vh, BLOCK_SIZE, IS_FP8, COMPUTE_DTYPE)
        m_i, l_i, acc = attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, qk_scale,
                                    SOFT_CAP)

    out_mask = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh
        tl.store(o_ptrs + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials are [B, Hq, NUM_SPLITS, HEAD_DIM] and [B, Hq, NUM_SPLITS], contiguous fp32.
        # An empty split stores lse = -inf and weighs nothing in the merge.
        row = (seq.to(tl.int64) * num_q_heads + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=mask_g)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh,
    num_q_heads,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[b, h] = sum_s w_s * part_out[b, h, s] with w_s = softmax over splits of lse_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    rows = (seq.to(tl.int64) * num_q_heads + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=mask_s, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # every split empty
    weights = tl.exp2(lse - lse_max)
    parts = tl.load(part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=mask_s[:, None] & mask_d[None, :], other=0.0)
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    o_ptrs = out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def choose_num_kv_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, num_sms: int
) -> int:
    """Splits so that (seqs x kv heads x splits) programs fill ~2 waves of SMs.

    Depends only on shapes (no device sync), so a CUDA graph captured for a batch size keeps it.
    """
    programs = num_seqs * num_kv_heads
    wanted = triton.cdiv(2 * num_sms, max(programs, 1))
    by_length = max(1, max_context_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, MAX_KV_SPLITS))


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT_CPU


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of query [B, Hq, D] (position seq_lens[b] - 1) over its paged context.

    num_kv_splits None picks one from the shapes (the context bound is the block table width,
    so nothing is read back from the device). k_scale / v_scale apply to an fp8 cache only.
    sliding_window: the query sees only the last `sliding_window` keys (itself included);
    logits_soft_cap: scores are capped as cap * tanh(score / cap).
    """
    is_fp8 = check_kv_cache(key_cache, value_cache)
    num_seqs, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim or num_q_heads % num_kv_heads:
        raise ValueError("query [B, Hq, D] does not match the KV cache [.., .., Hkv, D]")
    if query.stride(-1) != 1:
        raise ValueError("query head_dim must be contiguous")
    out = output_buffer(query, out)
    if num_seqs == 0:
        return out
    if num_kv_splits is None:
        max_context = min(block_tables.shape[1] * block_size, window_arg(sliding_window))
        num_kv_splits = choose_num_kv_splits(
            num_seqs, num_kv_heads, max_context, _sm_count(query.device)
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    group = num_q_heads // num_kv_heads
    if num_kv_splits > 1:
        part_out = torch.empty(
            (num_seqs, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32,
            device=query.device,
        )
        part_lse = torch.empty(
            (num_seqs, num_q_heads, num_kv_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel when NUM_SPLITS == 1
    k_scale_t = scale_arg(k_scale, is_fp8, key_cache)
    v_scale_t = scale_arg(v_scale, is_fp8, key_cache)
    block_d = next_pow2(head_dim, 16)
    with launch_device(query):
        _decode_kernel[(num_seqs, num_kv_heads, num_kv_splits)](
            query, key_cache, value_cache, block_tables, seq_lens, k_scale_t, v_scale_t,
            out, part_out, part_lse,
            scale * LOG2E, window_arg(sliding_window),
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            num_q_heads,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_G=next_pow2(group, 16), BLOCK_D=block_d, BLOCK_N=BLOCK_N,
            NUM_SPLITS=num_kv_splits, IS_FP8=is_fp8, COMPUTE_DTYPE=compute_dtype(query),
            SOFT_CAP=soft_cap_arg(logits_soft_cap),
        )
        if num_kv_splits > 1:
            _merge_splits_kernel[(num_seqs, num_q_heads)](
                part_out, part_lse, out,
                out.stride(0), out.stride(1),
                num_q_heads,
                HEAD_DIM=head_dim, NUM_SPLITS=num_kv_splits,
                BLOCK_S=next_pow2(num_kv_splits, 2), BLOCK_D=block_d,
            )
    return out
