"""Torch references of the quantized products: what each format's linear computes.

W4A16 (GPTQ / AWQ): w[k, n] = (code[k, n] - zero[g(k), n]) * scale[g(k), n] in fp32, g(k) =
g_idx[k] (computed as code * scale - zero * scale); the product runs in fp32 over the
dequantized weight. The CPU runs exactly this
(dequantized once at load) and the Triton kernel (kernels/triton_w4a16.py) is held to it.
FP8 W8A8 (compressed-tensors float-quantized): x is quantized per token to e4m3 at each call,
s_x = max|x_row| / 448; y = (q_x s_x) (q_w s_w)^T. The worker dequantizes FP8 weights at load
and leaves activations unquantized; fp8_linear says how far that is from the format's product.
"""

from __future__ import annotations

import torch

from services.worker.models.checkpoint_quant.int4_packing import unpack_rows

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max   # 448


def dequantize_int4(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor) -> torch.Tensor:
    """fp32 W [N, K] from qweight int32 [K/8, N] (GPTQ row packing), zeros [G, N], scales
    [G, N] and g_idx [K]."""
    codes = unpack_rows(qweight)                                    # [K, N]
    groups = g_idx.long()
    s = scales[groups].float()
    # NOTE: code * s - zero * s, not (code - zero) * s: the same value (both products are
    # exact for 16-bit scales), and also the same zero sign where a scale is 0, as GGUF
    # Q4_1's d * q + m (int4_weight.py) computes it.
    w = codes.float() * s - zeros[groups].float() * s
    return w.t().contiguous()


def w4a16_linear(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
                 scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T in fp32, returned in x's dtype."""
    return (x.float() @ dequantize_int4(qweight, zeros, scales, g_idx).t()).to(x.dtype)


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [M, K], fp32 scales [M, 1]): dynamic per-token, symmetric."""
    xf = x.float()
    scales = xf.abs().amax(dim=1, keepdim=True) / FP8_MAX
    divisor = torch.where(scales == 0, 1.0, scales)
    return (xf / divisor).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The FP8 W8A8 product: x quantized per token, weight e4m3 [N, K] with a per-channel
    ([N, 1]) or per-tensor scale; fp32 math, returned in x's dtype."""
    codes, scales = quantize_per_token_fp8(x)
    w = weight.float() * weight_scale.float().reshape(-1, 1)
    return ((codes.float() * scales) @ w.t()).to(x.dtype)
