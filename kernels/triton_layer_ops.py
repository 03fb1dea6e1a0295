"""A decoder layer's small steps as one Triton kernel each (the CUDA path of TritonLayerOps).

    rms_norm(x, weight, eps) -> out            x [T, D] or a [T, H, D] view (last dim dense)
    add_rms_norm(x, residual, weight, eps) -> out   and x += residual, in x's storage
    silu_and_mul(gate_up) -> out               [T, 2I] -> [T, I]
    rotary_embedding(x, cos, sin)              x [T, H, D] rotated in place (may be a view)

Each rounds where the torch expressions of services/worker/models/layer_ops.py and rotary.py
round (16-bit math in fp32, rounded to the model dtype after each torch op), so:
- silu_and_mul, rotary_embedding and the residual sum are bit-exact with torch on CUDA; the
  interpreter's numpy exp may differ from torch's CPU exp in the last fp32 bit, so on CPU
  silu_and_mul is within one ulp of the model dtype;
- rms_norm reduces the sum of squares in another order than torch (and rsqrt may differ in the
  last fp32 bit), so in 16-bit a value near a rounding tie may land one ulp away; fp32 is
  within a few fp32 ulps.

NOTE: kernels are launched with enable_fp_fusion=False: a fused multiply-add would skip the
rounding of x * cos before the add that torch does (fp32 rope would differ in the last bit).
Outputs are allocated with torch and nothing syncs the host, so CUDA graphs capture them.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.launch_device import launch_device

_NO_FMA = {"enable_fp_fusion": False}


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 x rounded to dtype, to nearest even.

    NOTE: triton 3.9's interpreter truncates fp32 -> bf16 (its "rtne" mode is wrong too), so
    the tests could not trust it; rounding the bits here leaves the conversion exact. On a GPU
    this is what cvt.rn.bf16.f32 does anyway, for a few ALU ops in memory-bound kernels.
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536   # -65536: 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _as_rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_rows, heads per token, token stride, head stride) of x [T, D] or [T, H, D]."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    num_heads, stride_xt, stride_xh, stride_rt, dim, eps,
    HAS_RESIDUAL: tl.constexpr, IS_FP32: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    token = (row // num_heads).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x_row = x_ptr + token * stride_xt + (row % num_heads) * stride_xh
    x = tl.load(x_row + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # The sum rounded to the model dtype, as x.add_(residual) stores it, is what is
        # normalized.
        residual = tl.load(residual_ptr + token * stride_rt + offs, mask=mask, other=0.0)
        x = _round(x.to(tl.float32) + residual.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(x_row + offs, x, mask=mask)
    xf = x.to(tl.float32)
    normed = xf * tl.math.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if not IS_FP32:
        # HF's LlamaRMSNorm: round the normalized value, then scale (the product of two
        # 16-bit values is exact in fp32, so it rounds once, as torch's 16-bit mul does).
        normed = _round(normed, out_ptr.dtype.element_ty).to(tl.float32)
    out = _round(normed * weight, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * dim + offs, out, mask=mask)


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    num_rows, num_heads, stride_xt, stride_xh = _as_rows(x)
    dim = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    with launch_device(out):
        _rms_norm_kernel[(num_rows,)](
            x, x if residual is None else residual, weight, out,
            num_heads, stride_xt, stride_xh, 0 if residual is None else residual.stride(0), dim,
            eps, HAS_RESIDUAL=residual is not None, IS_FP32=x.dtype == torch.float32,
            BLOCK_D=triton.next_power_of_2(dim), **_NO_FMA,
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, D] or [T, H, D] (x.stride(-1) == 1): a new tensor."""
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """rms_norm(x + residual) for x, residual [T, D]; the sum is written into x."""
    return _launch_rms_norm(x, residual, weight, eps)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, size, stride_gt,
    EXACT_EXP: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    gate = tl.load(gate_up_ptr + token * stride_gt + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + token * stride_gt + size + offs, mask=mask, other=0.0)
    # NOTE: torch's CUDA silu is x / (1 + expf(-x)) in fp32: libdevice's expf is the same
    # function and div_rn the same IEEE division (triton's `/` and tl.exp are approximate).
    # The interpreter has no libdevice.
    if EXACT_EXP:
        denominator = 1.0 + libdevice.exp(-gate)
    else:
        denominator = 1.0 + tl.exp(-gate)
    dtype = out_ptr.dtype.element_ty
    silu = _round(tl.math.div_rn(gate, denominator), dtype).to(tl.float32)
    out = _round(silu * up.to(tl.float32), dtype)
    tl.store(out_ptr + token * size + offs, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] ([T, 2I], last dim dense): [T, I]."""
    num_tokens, size = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(num_tokens, size, dtype=gate_up.dtype, device=gate_up.device)
    block = min(triton.next_power_of_2(size), 1024)
    with launch_device(out):
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(size, block))](
            gate_up, out, size, gate_up.stride(0),
            EXACT_EXP=gate_up.is_cuda, BLOCK=block, **_NO_FMA,
        )
    return out


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, num_heads, stride_xt, stride_xh, stride_ct, stride_st,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    mask = (heads < num_heads)[:, None] & mask_d[None, :]
    rows = x_ptr + token * stride_xt + heads[:, None] * stride_xh
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0)
    # roll(x, half) along the head dim: column j reads x[(j + half) mod head_dim].
    rolled_d = (offs_d + HEAD_DIM // 2) % HEAD_DIM
    rolled = tl.load(rows + rolled_d[None, :], mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_ct + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_st + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    # torch rounds x * cos and roll(x) * sin to the model dtype before the add.
    dtype = x_ptr.dtype.element_ty
    a = _round(x.to(tl.float32) * cos[None, :], dtype).to(tl.float32)
    b = _round(rolled.to(tl.float32) * sin[None, :], dtype).to(tl.float32)
    tl.store(rows + offs_d[None, :], _round(a + b, dtype), mask=mask)


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x [T, H, D] in place by cos, sin [T, 1, D] (rotate_half's sign folded into sin,
    rotary.py): x * cos + roll(x, D / 2) * sin. x may be a view with a dense last dim."""
    num_tokens, num_heads, head_dim = x.shape
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 4096 // block_d))
    with launch_device(x):
        _rotary_kernel[(num_tokens, triton.cdiv(num_heads, block_h))](
            x, cos, sin, num_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, **_NO_FMA,
        )
