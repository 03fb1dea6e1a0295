"""Fused mixture-of-experts on the GPU: two grouped GEMMs over token-expert pairs (vLLM's
fused_moe shape), with the gated activation and the sum over a token's experts in between.

The T x K token-expert pairs are sorted by expert (on the device, no host sync) and each
expert's group padded to a multiple of BLOCK_M (padding rows point past the last pair and are
masked), so every program (row block, column block) multiplies rows of a single expert by that
expert's weight tile:
    1. gate_up[p] = x[p // K] @ w13[e]^T                      [T * K, 2I]
    2. act = silu(gate) * up                                    [T * K, I]   (torch)
    3. y[p] = topk_weight[p] * (act[p] @ w2[e]^T)             [T * K, H]
    4. out[t] = sum_k y[t * K + k]                              (torch)
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.launch_device import launch_device

BLOCK_M = 16  # pair rows per program (>= 16 for GPU dots)
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr,
    num_pairs, n, k, a_row_div,
    stride_am, stride_be, stride_bn, stride_cm,
    MUL_WEIGHT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """c[p, n-block] = (a[p // a_row_div] @ b[e]^T)[n-block] (x weight[p]) for block's pairs p."""
    block_m = tl.program_id(0)
    block_n = tl.program_id(1)
    # Groups start block-aligned with real pairs: a block led by padding is all padding.
    if tl.load(sorted_pairs_ptr + block_m * BLOCK_M) >= num_pairs:
        return
    expert = tl.load(block_experts_ptr + block_m)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m)
    mask_m = pairs < num_pairs
    a_rows = tl.where(mask_m, pairs // a_row_div, 0).to(tl.int64)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_base = b_ptr + expert.to(tl.int64) * stride_be
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(a, tl.trans(b), input_precision="ieee")
    if MUL_WEIGHT:
        acc = acc * tl.load(pair_weights_ptr + pairs, mask=mask_m, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def align_pairs_by_expert(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs, block_experts): pair ids grouped by expert, each group padded to a
    multiple of block_m with the id num_pairs (masked), and each row block's expert.

    NOTE: sized by the worst case (every expert's group padded by block_m - 1), not by the
    counts, so nothing is read back to the host: a CUDA graph can capture it. Blocks past the
    last group hold padding only (their programs return at once).
    """
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    # NOTE: not bincount, which reads the largest id back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    first_pair = torch.cumsum(counts, 0) - counts      # each expert's first pair in `order`
    rank = torch.arange(num_pairs, device=flat.device) - first_pair[expert_of_sorted]
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=flat.device)
    sorted_pairs[(ends - padded)[expert_of_sorted] + rank] = order.to(torch.int32)
    block_starts = torch.arange(num_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(ends, block_starts, right=True)
    return sorted_pairs, block_experts.clamp_(max=num_experts - 1).to(torch.int32)


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, num_pairs: int, a_row_div: int,
                  pair_weights: torch.Tensor | None) -> torch.Tensor:
    n, k = b.shape[1], b.shape[2]
    c = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (block_experts.numel(), triton.cdiv(n, BLOCK_N))
    with launch_device(c):
        _grouped_gemm_kernel[grid](
            a, b, c, sorted_pairs, block_experts,
            pair_weights if pair_weights is not None else c,
            num_pairs, n, k, a_row_div,
            a.stride(0), b.stride(0), b.stride(1), c.stride(0),
            MUL_WEIGHT=pair_weights is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )
    return c


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """What kernels.moe_reference.ref_fused_moe computes (see there for the shapes)."""
    if hidden.stride(1) != 1 or w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("hidden, w13 and w2 need a contiguous last dimension")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    sorted_pairs, block_experts = align_pairs_by_expert(topk_ids, w13.shape[0], BLOCK_M)
    gate_up = _grouped_gemm(hidden, w13, sorted_pairs, block_experts, num_pairs, top_k, None)
    intermediate = w2.shape[2]
    act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    out = _grouped_gemm(act, w2, sorted_pairs, block_experts, num_pairs, 1, weights)
    return out.view(num_tokens, top_k, -1).sum(dim=1)
