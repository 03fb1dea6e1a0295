"""The Triton W4A16 GEMM (kernels/triton_w4a16.py) against the torch reference
(checkpoint_quant/reference.py) at small shapes, compiled on CUDA and under the interpreter on
CPU: symmetric and asymmetric zero points, a group size and one group (-1), act-order g_idx,
fp32 and bf16 activations, shapes off the tile sizes (masked edges), and the model's
W4A16Linear over fused parts with a bias.
Runnable as `python -m tests.kernels.test_triton_w4a16` (on KERNEL_TEST_DEVICE): one JSON line
per case. The pytest test runs that in a subprocess (tests/kernels/harness.py says why).
"""

from __future__ import annotations

import json
from dataclasses import fields

import torch

from services.worker.models.checkpoint_quant.int4_packing import pack_rows
from services.worker.models.checkpoint_quant.int4_weight import Int4Weight
from services.worker.models.checkpoint_quant.reference import dequantize_int4, w4a16_linear
from tests.kernels.harness import DEVICE, json_cases

# (name, M, K, N, group_size (-1: one group), symmetric, act order, activation dtype)
CASES = [
    ("sym_g32_fp32", 5, 64, 48, 32, True, False, torch.float32),
    ("asym_g32_fp32_20_rows", 20, 96, 40, 32, False, False, torch.float32),
    ("asym_one_group_fp32", 3, 64, 32, -1, False, False, torch.float32),
    ("asym_g16_act_order_fp32", 17, 64, 24, 16, False, True, torch.float32),
    ("sym_g32_bf16", 4, 64, 48, 32, True, False, torch.bfloat16),
    ("asym_g32_act_order_bf16_one_row", 1, 96, 72, 32, False, True, torch.bfloat16),
]
FUSED_LINEAR_CASE = "w4a16_linear_fused_with_bias"


def make_inputs(m: int, k: int, n: int, group_size: int, sym: bool, act_order: bool,
                dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """x [M, K], qweight [K/8, N], zeros uint8 [G, N], fp16 scales [G, N], g_idx [K]."""
    gen = torch.Generator().manual_seed(m * k + n)
    size = k if group_size == -1 else group_size
    num_groups = k // size
    g_idx = torch.arange(k, dtype=torch.int32) // size
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    codes = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.int32)
    zeros = (torch.full((num_groups, n), 8) if sym
             else torch.randint(0, 16, (num_groups, n), generator=gen)).to(torch.uint8)
    scales = (torch.rand(num_groups, n, generator=gen) * 0.1 + 0.01).to(torch.float16)
    x = torch.randn(m, k, generator=gen).to(dtype)
    return x, pack_rows(codes), zeros, scales, g_idx


def _compare_triton_with_reference() -> None:
    from kernels.triton_w4a16 import w4a16_gemm
    from services.worker.models.checkpoint_quant.w4a16_linear import W4A16Linear

    for name, *shape, dtype in CASES:
        inputs = make_inputs(*shape, dtype)
        got = w4a16_gemm(*(t.to(DEVICE) for t in inputs)).cpu()
        _report(name, got, w4a16_linear(*inputs), dtype)
    # The model's linear: q/k/v-like parts fused along N, plus a bias.
    parts = [Int4Weight(*make_inputs(3, 64, n, 32, False, False, torch.float32)[1:])
             for n in (32, 16, 16)]
    weight = Int4Weight.cat(parts)
    x, bias = torch.randn(3, 64), torch.randn(64)
    want = x @ weight.dequantize().t() + bias
    on_device = Int4Weight(*(getattr(weight, f.name).to(DEVICE) for f in fields(weight)))
    got = W4A16Linear(on_device, bias.to(DEVICE))(x.to(DEVICE)).cpu()
    _report(FUSED_LINEAR_CASE, got, want, torch.float32)


def _report(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    print(json.dumps({"case": name, "dtype_ok": got.dtype == want.dtype,
                      "shape_ok": got.shape == want.shape,
                      "err": error_in_bounds(got.float(), want.float(), dtype)}), flush=True)


def error_in_bounds(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> float:
    """max |got - want| over its bound (<= 1 passes): 1e-5 of the largest output for the fp32
    sums taken in another order, plus, for a 16-bit output, one unit in the last place of
    each value (the interpreter converts fp32 to bf16 by truncation, not to nearest)."""
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 0.0
    bound = ulp * want.abs() + 1e-5 * want.abs().max()
    return float(((got - want).abs() / bound).max())


def test_reference_dequantizes_each_row_by_its_group() -> None:
    x, qweight, zeros, scales, g_idx = make_inputs(1, 64, 16, 16, False, True, torch.float32)
    w = dequantize_int4(qweight, zeros, scales, g_idx)
    codes = torch.stack([(qweight[k // 8] >> (4 * (k % 8))) & 0xF for k in range(64)])
    k, n = 37, 5
    group = int(g_idx[k])
    assert w[n, k] == (int(codes[k, n]) - int(zeros[group, n])) * float(scales[group, n])


def test_triton_w4a16_matches_reference() -> None:
    results = json_cases("tests.kernels.test_triton_w4a16")
    assert set(results) == {c[0] for c in CASES} | {FUSED_LINEAR_CASE}
    for name in results:
        result = results[name]
        assert result["shape_ok"] and result["dtype_ok"] and result["err"] <= 1, result

if __name__ == "__main__":
    _compare_triton_with_reference()
