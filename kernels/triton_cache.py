"""reshape_and_cache: write this step's keys and values into their paged-cache slots.

One program per token copies all of its KV heads ([Hkv, D], padded with masks) for both K and
V. A negative slot (vLLM's padding convention) leaves the cache untouched. An fp8 (e4m3) cache
stores x / scale saturated to +-448, as vLLM's saturating conversion does.
"""

import torch
import triton
import triton.language as tl

from kernels.launch_device import launch_device
from kernels.reference import FP8_E4M3_MAX
from kernels.triton_paged_kv import check_kv_cache, next_pow2, scale_arg

# NOTE: a jit function may only read globals that are tl.constexpr.
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: x + M - M rounds to an integer, to even


@triton.jit
def _round_to_e4m3_grid(x):
    """Rounds fp32 x (|x| <= 448) to the nearest e4m3 value, ties to even, staying in fp32.

    NOTE: triton 3.9's interpreter converts fp32 -> fp8 wrongly (ties round away from zero and a
    mantissa carry can halve the value: 124.2 -> 64), so the tests could not trust it. Rounding
    here first leaves the conversion exact everywhere; on a GPU, where cvt.rn.satfinite is
    right anyway, it costs a few ALU ops in a memory-bound kernel.
    """
    exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # below 2**-6 e4m3 is subnormal: fixed 2**-9 steps
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    inv_step = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    return ((x * inv_step + _RNE_MAGIC) - _RNE_MAGIC) * step


@triton.jit
def _store_token(
    src_ptr, cache_ptr, scale_ptr, token, slot_row,
    stride_st, stride_sh, stride_co, stride_ch,
    offs_h, offs_d, mask,
    IS_FP8: tl.constexpr,
):
    src = tl.load(src_ptr + token * stride_st + offs_h[:, None] * stride_sh + offs_d[None, :],
                  mask=mask, other=0.0)
    if IS_FP8:
        # NOTE: IEEE division (a GPU's `/` may be 2 ulp off), so a GPU writes the same bytes
        # as torch's x / scale in the reference.
        src = tl.math.div_rn(src.to(tl.float32), tl.load(scale_ptr))
        src = _round_to_e4m3_grid(tl.minimum(tl.maximum(src, -_FP8_MAX), _FP8_MAX))
    dst = cache_ptr + slot_row + offs_h[:, None] * stride_ch + offs_d[None, :]
    tl.store(dst, src.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kco, stride_kch,
    stride_vcb, stride_vco, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, IS_FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    _store_token(key_ptr, key_cache_ptr, k_scale_ptr, token,
                 block * stride_kcb + offset * stride_kco,
                 stride_kt, stride_kh, stride_kco, stride_kch, offs_h, offs_d, mask, IS_FP8)
    _store_token(value_ptr, value_cache_ptr, v_scale_ptr, token,
                 block * stride_vcb + offset * stride_vco,
                 stride_vt, stride_vh, stride_vco, stride_vch, offs_h, offs_d, mask, IS_FP8)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
) -> None:
    """Writes key/value [T, Hkv, D] into the caches at slot_mapping [T] (int64) in place.

    key/value may be strided views (e.g. slices of a fused qkv output) as long as head_dim is
    contiguous. k_scale / v_scale apply to an fp8 cache only (None = 1.0).
    """
    is_fp8 = check_kv_cache(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError("key/value [T, Hkv, D] do not match the KV cache [.., .., Hkv, D]")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping needs one slot per token")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim must be contiguous")
    if num_tokens == 0:
        return
    with launch_device(key_cache):
        _reshape_and_cache_kernel[(num_tokens,)](
            key, value, key_cache, value_cache, slot_mapping,
            scale_arg(k_scale, is_fp8, key_cache), scale_arg(v_scale, is_fp8, key_cache),
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=key_cache.shape[1],
            BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim), IS_FP8=is_fp8,
        )
