"""Varlen prefill attention over a paged context (cached prefix, chunked prefill, decode rows).

Program (q block, kv head) takes BLOCK_Q consecutive query tokens of one sequence times the
GROUP query heads that read that kv head, flattened into BLOCK_M = BLOCK_Q x BLOCK_G rows
(row = token * BLOCK_G + head-in-group), so each K/V tile is loaded once for all of them. Keys
come from the paged cache only: the cache write of this step runs before attention. With a
sliding window the key loop starts at the first key the block's first query still sees.

The grid needs no host sync: sequence b's q blocks are numbered from
query_start_loc[b] // BLOCK_Q + b, which leaves room for cdiv(q_len_b, BLOCK_Q) blocks, so
T // BLOCK_Q + num_seqs programs cover every sequence; each program finds its sequence by a
binary search and programs past the end of their sequence exit at once.
"""

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

BLOCK_M = 64  # query rows (tokens x heads in group) per program
BLOCK_N = 64  # keys per tile


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The last sequence b whose first q block (query_start_loc[b] // BLOCK_Q + b) <= q_block."""
    # NOTE: annotated so the loop-carried types stay int32 even when triton specializes
    # num_seqs == 1 to a constant.
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    k_scale_ptr, v_scale_ptr, out_ptr,
    qk_scale, num_seqs, window,
    stride_qt, stride_qh,
    stride_kb, stride_ko, stride_kh,
    stride_vb, stride_vo, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr, COMPUTE_DTYPE: tl.constexpr, SOFT_CAP: tl.constexpr,
):
    kv_head = tl.program_id(1)
    q_block_global = tl.program_id(0)
    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block_global, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_global - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # tokens already in the cache before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = q_block * BLOCK_Q + offs_m // BLOCK_G  # token index within the sequence's queries
    head_in_group = offs_m % BLOCK_G
    mask_m = (q_idx < q_len) & (head_in_group < GROUP)
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + head_in_group
    tokens = (q_start + q_idx).to(tl.int64)
    q_ptrs = q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0).to(COMPUTE_DTYPE)
    q_pos = context_len + q_idx

    k_scale = 1.0
    v_scale = 1.0
    if IS_FP8:
        k_scale = tl.load(k_scale_ptr)
        v_scale = tl.load(v_scale_ptr)

    # The last query of this block sees keys up to its own position, and no further; the
    # first sees none at or before its position - window.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    kv_begin = tl.maximum(context_len + q_block * BLOCK_Q - window + 1, 0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(kv_begin, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        k = load_kv_tile(k_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, mask_d, k_scale,
                         stride_kb, stride_ko, stride_kh, BLOCK_SIZE, IS_FP8, COMPUTE_DTYPE)
        v = load_kv_tile(v_cache_ptr, bt_row, offs_n, mask_n, kv_head, offs_d, mask_d, v_scale,
                         stride_vb, stride_vo, stride_vh, BLOCK_SIZE, IS_FP8, COMPUTE_DTYPE)
        visible = (mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
                   & (offs_n[None, :] > q_pos[:, None] - window))
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, SOFT_CAP)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the flattened varlen query [T, Hq, D] over each sequence's pages.

    max_query_len is accepted for vLLM parity; the grid is sized from T and the batch instead,
    so a wrong value cannot drop query rows. k_scale / v_scale apply to an fp8 cache only.
    sliding_window: query position p sees keys (p - sliding_window, p]; logits_soft_cap:
    scores are capped as cap * tanh(score / cap).
    """
    del max_query_len
    is_fp8 = check_kv_cache(key_cache, value_cache)
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = key_cache.shape
    if head_dim != cache_head_dim or num_q_heads % num_kv_heads:
        raise ValueError("query [T, Hq, D] does not match the KV cache [.., .., Hkv, D]")
    if query.stride(-1) != 1:
        raise ValueError("query head_dim must be contiguous")
    out = output_buffer(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    block_g = next_pow2(group)
    block_m = max(BLOCK_M, block_g)
    block_q = block_m // block_g
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    with launch_device(query):
        _prefill_kernel[grid](
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
            scale_arg(k_scale, is_fp8, key_cache), scale_arg(v_scale, is_fp8, key_cache), out,
            scale * LOG2E, num_seqs, window_arg(sliding_window),
            query.stride(0), query.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_tables.stride(0),
            out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
            BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_M=block_m,
            BLOCK_D=next_pow2(head_dim, 16), BLOCK_N=BLOCK_N,
            IS_FP8=is_fp8, COMPUTE_DTYPE=compute_dtype(query),
            SOFT_CAP=soft_cap_arg(logits_soft_cap),
        )
    return out
