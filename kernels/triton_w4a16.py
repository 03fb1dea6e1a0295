"""W4A16 GEMM on the GPU: y = x @ W^T with W 4-bit (GPTQ / AWQ checkpoints), dequantized tile
by tile inside the kernel, never whole in memory.

Layout (services/worker/models/checkpoint_quant/int4_weight.py): qweight int32 [K/8, N], row
k's code at bits 4 * (k % 8) of word row k // 8; zeros uint8 and scales [G, N]; g_idx int32
[K] gives row k's group (act-order permutes it). Each program computes a BLOCK_M x BLOCK_N
tile of y; per BLOCK_K step it loads the words covering its rows, shifts out each row's code
and gathers that row's zero and scale: w = code * scale - zero * scale in fp32, exactly as
the torch reference (checkpoint_quant/reference.py) computes it.
NOTE: the dot runs in fp32 ("ieee"): the interpreter mangles bf16 dots and the reference is
fp32; a bf16 dot would be faster on the GPU at some cost in agreement.
"""

import torch
import triton
import triton.language as tl

from kernels.launch_device import launch_device

BLOCK_M = 16  # >= 16 for GPU dots
BLOCK_N = 32
BLOCK_K = 32


@triton.jit
def _w4a16_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, g_idx_ptr, y_ptr, m, n, k,
    stride_xm, stride_qk, stride_zg, stride_sg, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < m
    mask_n = offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k
        mask_kn = mask_k[:, None] & mask_n[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        words = tl.load(qweight_ptr + (offs_k // 8)[:, None] * stride_qk + offs_n[None, :],
                        mask=mask_kn, other=0)
        codes = (words >> ((offs_k % 8) * 4)[:, None]) & 0xF
        groups = tl.load(g_idx_ptr + offs_k, mask=mask_k, other=0)
        zeros = tl.load(zeros_ptr + groups[:, None] * stride_zg + offs_n[None, :],
                        mask=mask_kn, other=0)
        scales = tl.load(scales_ptr + groups[:, None] * stride_sg + offs_n[None, :],
                         mask=mask_kn, other=0.0).to(tl.float32)
        w = codes.to(tl.float32) * scales - zeros.to(tl.float32) * scales   # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w4a16_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
               scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """x [M, K] (contiguous rows) @ W^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    assert qweight.shape[0] * 8 == k and g_idx.shape == (k,), (x.shape, qweight.shape)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    with launch_device(y):
        _w4a16_kernel[grid](
            x, qweight, zeros, scales, g_idx, y, m, n, k,
            x.stride(0), qweight.stride(0), zeros.stride(0), scales.stride(0), y.stride(0),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
