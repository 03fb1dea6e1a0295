"""Torch reference implementations of the paged-KV kernels.

Simple and obviously right rather than fast: every function gathers one sequence at a time,
does its math in fp32 and casts the result to the query dtype. The Triton kernels are tested
against these, and the worker's `torch` attention backend may call them directly.

Layout (vLLM's flash layout): key_cache / value_cache are
[num_blocks, block_size, num_kv_heads, head_dim]; token slot = block_id * block_size + offset;
block 0 is the reserved null block that padded block-table entries point at.
"""

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn value; quantization saturates here


def _scale_value(scale: float | torch.Tensor | None) -> float:
    """A per-tensor scale as a Python float (None = 1.0, i.e. no scaling)."""
    if scale is None:
        return 1.0
    return float(scale)


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Writes key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot < 0 is skipped.

    A float8_e4m3fn cache stores x / scale, saturated to +-448 (scales are ignored otherwise).
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        rows = src[keep]
        if cache.dtype == torch.float8_e4m3fn:
            # NOTE: divide by a device tensor: CUDA torch turns `/ python_float` into a multiply
            # by the reciprocal, which can round differently from the kernel's true division.
            divisor = torch.tensor(_scale_value(scale), dtype=torch.float32, device=rows.device)
            rows = (rows.float() / divisor).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        flat[slots] = rows.to(cache.dtype)


def _gather_context(
    cache: torch.Tensor,
    block_table_row: torch.Tensor,
    seq_len: int,
    scale: float | torch.Tensor | None,
) -> torch.Tensor:
    """Keys (or values) of positions 0..seq_len-1 of one sequence as fp32 [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table_row.long()[positions // block_size]
    rows = cache[blocks, positions % block_size].float()
    if cache.dtype == torch.float8_e4m3fn:
        rows = rows * _scale_value(scale)
    return rows


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of q [Lq, Hq, D] over k, v [Lk, Hkv, D] (key j at position j), fp32.

    With a sliding window, query position p sees keys p - sliding_window < j <= p; with a
    soft-cap, scores become cap * tanh(scores / cap) before masking and the softmax.
    """
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    key_positions = torch.arange(k.shape[0], device=q.device)
    visible = key_positions[None, :] <= q_positions[:, None]  # [Lq, Lk]
    if sliding_window is not None:
        visible &= key_positions[None, :] > q_positions[:, None] - sliding_window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def ref_paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Varlen causal attention over a paged context; returns [T, Hq, D] in query.dtype.

    Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1] (q_len of them), which
    sit at positions seq_lens[b] - q_len .. seq_lens[b] - 1. max_query_len is unused here (the
    kernel needs it to size its grid); it is accepted so both share one signature.
    """
    del max_query_len
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[b], starts[b + 1]
        if q_end == q_start:
            continue
        k = _gather_context(key_cache, block_tables[b], seq_len, k_scale)
        v = _gather_context(value_cache, block_tables[b], seq_len, v_scale)
        q_positions = torch.arange(seq_len - (q_end - q_start), seq_len, device=query.device)
        out[q_start:q_end] = _attend(
            query[q_start:q_end], k, v, q_positions, scale, sliding_window, logits_soft_cap
        ).to(query.dtype)
    return out


def ref_paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_kv_splits: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence (query [B, Hq, D]) at position seq_lens[b] - 1.

    num_kv_splits only matters to the kernel (how the work is cut); accepted for one signature.
    """
    del num_kv_splits
    num_seqs = query.shape[0]
    query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    return ref_paged_prefill_attention(
        query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
        k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
        logits_soft_cap=logits_soft_cap,
    )
