"""TritonLayerOps (kernels/triton_layer_ops.py) against TorchLayerOps and torch's rope.

Cases for kernel_cases.CASES (run in-process on CUDA, in the interpreter on CPU). Shapes are
small and not powers of two, so the masks are exercised. fp32 is compared within 1e-5;
16-bit in ulps of the model dtype: 0 where the kernels promise torch's bits; 2 for RMSNorm,
whose sum of squares is reduced in another order, and, on CPU, for SiLU, whose exp is numpy's
in the interpreter: the intermediate (normalized x, silu(gate)) may round the other way at a
near-tie, one ulp, which the product with the weight / up may stretch to two.
"""

from collections.abc import Callable
from functools import partial

import torch

from services.worker.models.layer_ops import TorchLayerOps
from services.worker.models.rotary import RotaryEmbedding
from tests.kernels.paged_batch import DTYPES

# NOTE: without the HF rounding step (normalize, round, then scale) ~1/4 of 16-bit RMSNorm
# outputs move by an ulp; a sum reduced in another order moves only a rare near-tie.
MIN_EXACT_FRACTION = 0.99


def ulp_distance(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| in units in the last place of their dtype, elementwise (+0 == -0)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape)
    int_dtype, magnitude = ((torch.int32, 0x7FFFFFFF) if got.dtype == torch.float32
                            else (torch.int16, 0x7FFF))

    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(int_dtype).long()
        return torch.where(bits < 0, -(bits & magnitude), bits)

    return (ordered(got) - ordered(want)).abs()


def assert_matches(got: torch.Tensor, want: torch.Tensor, max_ulps: int) -> None:
    """fp32 within 1e-5; 16-bit within max_ulps and nearly all bit-exact."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return
    distance = ulp_distance(got, want)
    assert int(distance.max()) <= max_ulps, f"{int(distance.max())} ulps > {max_ulps}"
    exact = float((distance == 0).float().mean())
    assert exact >= MIN_EXACT_FRACTION, f"only {exact:.3f} of the elements are bit-exact"


def _ops() -> tuple[TorchLayerOps, TorchLayerOps]:
    from services.worker.models.layer_ops import TritonLayerOps

    return TritonLayerOps(), TorchLayerOps()


def _randn(gen: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def check_rms_norm(device: str, dtype: str, shape: tuple[int, ...],
                   view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> None:
    """RMSNorm of view(x) for x of `shape` (a view: Qwen3's q / k norm of a qkv slice)."""
    gen = torch.Generator().manual_seed(2)
    torch_dtype = DTYPES[dtype]
    x = view(_randn(gen, *shape, scale=3.0).to(torch_dtype).to(device))
    weight = (torch.rand(x.shape[-1], generator=gen) + 0.5).to(torch_dtype).to(device)
    triton_ops, torch_ops = _ops()
    got = triton_ops.rms_norm(x, weight, 1e-6)
    assert got.shape == x.shape
    assert_matches(got, torch_ops.rms_norm(x, weight, 1e-6), max_ulps=2)


def check_add_rms_norm(device: str, dtype: str, num_tokens: int, hidden: int,
                       has_residual: bool = True) -> None:
    gen = torch.Generator().manual_seed(3)
    torch_dtype = DTYPES[dtype]
    x = _randn(gen, num_tokens, hidden, scale=2.0).to(torch_dtype).to(device)
    residual = _randn(gen, num_tokens, hidden, scale=8.0).to(torch_dtype).to(device)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(torch_dtype).to(device)
    triton_ops, torch_ops = _ops()
    x_got, x_want = x.clone(), x.clone()
    got, got_sum = triton_ops.add_rms_norm(x_got, residual if has_residual else None, weight,
                                           1e-5)
    want, want_sum = torch_ops.add_rms_norm(x_want, residual if has_residual else None, weight,
                                            1e-5)
    assert got_sum.data_ptr() == x_got.data_ptr()   # the sum lives in x's storage
    assert torch.equal(x_got, x_want)               # the same rounded sum as x.add_(residual)
    assert torch.equal(got_sum, want_sum)
    assert_matches(got, want, max_ulps=2)


def check_silu_and_mul(device: str, dtype: str, num_tokens: int, size: int) -> None:
    gen = torch.Generator().manual_seed(4)
    # Gates up to ~+-20: exp(-x) over a wide range of magnitudes.
    gate_up = _randn(gen, num_tokens, 2 * size, scale=5.0).to(DTYPES[dtype]).to(device)
    triton_ops, torch_ops = _ops()
    got = triton_ops.silu_and_mul(gate_up)
    assert got.shape == (num_tokens, size)
    want = torch_ops.silu_and_mul(gate_up)
    if device == "cuda":
        assert torch.equal(got, want), int(ulp_distance(got, want).max())
    else:
        assert_matches(got, want, max_ulps=2)


def check_rotary(device: str, dtype: str, positions: list[int], num_q_heads: int,
                 num_kv_heads: int, head_dim: int) -> None:
    """q and k rotated together in place through their view of a qkv output, as llama.py."""
    from kernels import triton_layer_ops

    torch_dtype = DTYPES[dtype]
    args = (head_dim, 4096, 10000.0, None, torch_dtype, torch.device(device))
    fused, plain = RotaryEmbedding(*args, ops=triton_layer_ops), RotaryEmbedding(*args)
    cos, sin = plain.lookup(torch.tensor(positions, device=device))
    gen = torch.Generator().manual_seed(5)
    num_tokens, num_qk_heads = len(positions), num_q_heads + num_kv_heads
    qkv = _randn(gen, num_tokens, (num_qk_heads + num_kv_heads) * head_dim).to(torch_dtype)
    qkv = qkv.to(device)
    qk = qkv[:, :num_qk_heads * head_dim].view(num_tokens, num_qk_heads, head_dim)
    want = plain.apply(qk.clone(), cos, sin)
    v_before = qkv[:, num_qk_heads * head_dim:].clone()
    got = fused.apply(qk, cos, sin)
    assert got.data_ptr() == qkv.data_ptr()                  # rotated in place
    assert torch.equal(qkv[:, num_qk_heads * head_dim:], v_before)   # v untouched
    # NOTE: exact in every dtype: the same roundings as torch's mul, mul, add (no fused
    # multiply-add; 16-bit products are exact in fp32).
    assert torch.equal(got, want), int(ulp_distance(got, want).max())


def check_fallbacks(device: str) -> None:
    """Inputs the kernels do not take run the torch versions: same results as TorchLayerOps."""
    gen = torch.Generator().manual_seed(6)
    triton_ops, torch_ops = _ops()
    transposed = _randn(gen, 40, 6).to(device).t()            # last dim strided
    weight = torch.rand(40, generator=gen).to(device) + 0.5
    assert torch.equal(triton_ops.rms_norm(transposed, weight, 1e-6),
                       torch_ops.rms_norm(transposed, weight, 1e-6))
    x = _randn(gen, 3, 40).to(torch.bfloat16).to(device)
    fp32_weight = weight.float()                               # promotes to fp32 in torch
    got = triton_ops.rms_norm(x, fp32_weight, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch_ops.rms_norm(x, fp32_weight, 1e-6))


LAYER_OPS_CHECKS: dict[str, Callable[[str], None]] = {
    "layer_ops_rms_norm_fp32_rows": partial(check_rms_norm, dtype="float32", shape=(5, 67)),
    "layer_ops_rms_norm_bf16_rows": partial(check_rms_norm, dtype="bfloat16", shape=(9, 200)),
    "layer_ops_rms_norm_fp16_rows": partial(check_rms_norm, dtype="float16", shape=(4, 130)),
    # Qwen3: the q heads of a [T, Hq + 2 Hkv, D] qkv output, a strided [T, H, D] view.
    "layer_ops_rms_norm_bf16_head_view": partial(
        check_rms_norm, dtype="bfloat16", shape=(6, 11, 48), view=lambda t: t[:, 2:9]),
    "layer_ops_rms_norm_fp32_head_view": partial(
        check_rms_norm, dtype="float32", shape=(3, 5, 40), view=lambda t: t[:, 1:4]),
    "layer_ops_add_rms_norm_fp32": partial(
        check_add_rms_norm, dtype="float32", num_tokens=5, hidden=67),
    "layer_ops_add_rms_norm_bf16": partial(
        check_add_rms_norm, dtype="bfloat16", num_tokens=7, hidden=200),
    "layer_ops_add_rms_norm_fp16": partial(
        check_add_rms_norm, dtype="float16", num_tokens=3, hidden=96),
    "layer_ops_add_rms_norm_bf16_no_residual": partial(
        check_add_rms_norm, dtype="bfloat16", num_tokens=4, hidden=72, has_residual=False),
    "layer_ops_silu_and_mul_fp32": partial(
        check_silu_and_mul, dtype="float32", num_tokens=5, size=45),
    "layer_ops_silu_and_mul_bf16_two_blocks": partial(
        check_silu_and_mul, dtype="bfloat16", num_tokens=3, size=1100),
    "layer_ops_silu_and_mul_fp16": partial(
        check_silu_and_mul, dtype="float16", num_tokens=4, size=77),
    "layer_ops_rotary_fp32_gqa3": partial(
        check_rotary, dtype="float32", positions=[0, 7, 300, 4095], num_q_heads=9,
        num_kv_heads=3, head_dim=64),
    "layer_ops_rotary_bf16_head48": partial(
        check_rotary, dtype="bfloat16", positions=[3, 1, 2000], num_q_heads=4,
        num_kv_heads=2, head_dim=48),
    "layer_ops_rotary_fp16_head80": partial(
        check_rotary, dtype="float16", positions=[12, 99], num_q_heads=5,
        num_kv_heads=1, head_dim=80),
    "layer_ops_fallbacks": check_fallbacks,
}
