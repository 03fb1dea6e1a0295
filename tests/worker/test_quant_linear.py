"""quant_linear (kernels/cpu/quant_linear.cpp) on random GGUF Q4_1 and Q8_0 blocks: it
expands them to exactly the values gguf's dequantizer gives, its products match a dense
matmul over those values, and a row's result does not depend on the rows beside it (nor on
which of its paths, registers or panel, the batch size picks); and Linear reads the blocks
only up to Linear.max_block_rows rows and only when they are the loaded weight, and
accumulates 16-bit products in fp32 whether or not the CPU has a 16-bit GEMM. A bf16 model's
rows are multiplied as bf16 pairs where the CPU has AVX512-BF16, with the same guarantees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.models.quantized import PackedBlocks, QuantizedMatrix
from services.worker.models.layers import (QUANTIZED_MAX_ROWS, QUANTIZED_MAX_ROWS_BF16_DOT,
                                            QUANTIZED_MAX_ROWS_BF16_GEMM, Linear)
from tests.worker.cpu_kernels import num_threads, require_cpu_ops


def random_blocks(n: int, k: int, kind: str, seed: int = 0) -> QuantizedMatrix:
    rng = np.random.default_rng(seed)
    num_blocks = k // 32

    def fp16(*shape: int) -> torch.Tensor:   # scales as GGUF stores them: fp16, widened
        return torch.from_numpy(rng.normal(0, 0.02, shape).astype(np.float16).astype(np.float32))

    if kind == "Q4_1":
        quants = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        return QuantizedMatrix(fp16(n, num_blocks), fp16(n, num_blocks), torch.from_numpy(quants))
    quants = rng.integers(-128, 128, (n, k), dtype=np.int8).view(np.uint8)
    return QuantizedMatrix(fp16(n, num_blocks), torch.empty(0), torch.from_numpy(quants))


def quant_linear(ops, x: torch.Tensor, q: QuantizedMatrix,  # noqa: ANN001
                 bf16: bool = False) -> torch.Tensor:
    packed = PackedBlocks.of(q, ops.vec_size, bf16)
    return ops.quant_linear(x, packed.blocks, packed.q4, packed.bf16)


def gguf_dequantize(q: QuantizedMatrix) -> np.ndarray:
    """gguf-py's formulas in numpy, independent of QuantizedMatrix.dequantize."""
    n, num_blocks = q.scales.shape
    d = q.scales.numpy()[:, :, None]
    if q.mins.numel():
        packed = q.quants.numpy().reshape(n, num_blocks, 16)
        nibbles = np.concatenate([packed & 0x0F, packed >> 4], axis=2).astype(np.float32)
        return ((d * nibbles) + q.mins.numpy()[:, :, None]).reshape(n, -1)
    ints = q.quants.numpy().view(np.int8).reshape(n, num_blocks, 32).astype(np.float32)
    return (d * ints).reshape(n, -1)


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_blocks_expand_to_the_dequantized_values_exactly(kind: str) -> None:
    ops = require_cpu_ops()
    q = random_blocks(48, 96, kind)
    want = gguf_dequantize(q)
    assert np.array_equal(q.dequantize().numpy(), want)
    # One-hot rows pick single weights: y = I W^T = W^T, with no rounding in between
    # (96 rows: the panel path; 1 row: the register path).
    assert np.array_equal(quant_linear(ops, torch.eye(96), q).numpy(), want.T)
    assert np.array_equal(quant_linear(ops, torch.eye(96)[7:8], q).numpy(), want.T[7:8])
    # A bf16 model's weights: the same values rounded to bf16 as torch rounds them.
    want_bf16 = torch.from_numpy(want).to(torch.bfloat16).float().T
    assert torch.equal(quant_linear(ops, torch.eye(96), q, bf16=True), want_bf16)
    assert torch.equal(quant_linear(ops, torch.eye(96)[7:8], q, bf16=True), want_bf16[7:8])
    # bf16 rows (multiplied as bf16 pairs where the CPU has AVX512-BF16): the same values.
    assert torch.equal(quant_linear(ops, torch.eye(96)[5:13].bfloat16(), q, bf16=True),
                       want_bf16[5:13])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_products_match_a_dense_matmul_and_are_batch_invariant(kind: str, threads: int) -> None:
    ops = require_cpu_ops()
    # 80 columns: panels of two groups (and, with AVX-512's 16-wide groups, a single group
    # after them); 17 rows: both paths, tiles of several heights; 320 of K: panel chunks
    # carried through y.
    q = random_blocks(80, 320, kind, seed=1)
    weight = torch.from_numpy(gguf_dequantize(q))
    x = torch.randn(17, 320, generator=torch.Generator().manual_seed(2))
    with num_threads(threads):
        y = quant_linear(ops, x, q)
        alone = [quant_linear(ops, x[i:i + 1], q) for i in range(17)]
        leading = [quant_linear(ops, x[:m], q) for m in range(2, 17)]
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(y[i:i + 1], row) for i, row in enumerate(alone))
    assert all(torch.equal(y[:len(part)], part) for part in leading)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_bf16_rows_match_a_dense_matmul_and_are_batch_invariant(kind: str, threads: int) -> None:
    # Up to the 8 rows a bf16 Linear reads blocks for: on a CPU with AVX512-BF16 they are
    # summed as bf16 pairs, elsewhere widened to fp32 and summed in one chain.
    ops = require_cpu_ops()
    q = random_blocks(80, 320, kind, seed=8)
    weight = q.dequantize().to(torch.bfloat16)
    x = torch.randn(8, 320, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    with num_threads(threads):
        y = quant_linear(ops, x, q, bf16=True)
        alone = [quant_linear(ops, x[i:i + 1], q, bf16=True) for i in range(8)]
        leading = [quant_linear(ops, x[:m], q, bf16=True) for m in range(2, 8)]
    assert y.dtype == torch.float32
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(y[i:i + 1], row) for i, row in enumerate(alone))
    assert all(torch.equal(y[:len(part)], part) for part in leading)


def test_linear_reads_blocks_for_small_batches_only_and_only_if_they_are_its_weight() -> None:
    ops = require_cpu_ops()
    q = random_blocks(64, 128, "Q4_1", seed=3)
    weight = q.dequantize()
    linear = Linear(weight.clone(), quantized=q, kernels=ops)
    assert linear.quantized is not None
    rows = linear.max_block_rows
    assert rows >= 8
    # An empty batch (a step with nothing for this linear) is empty, with blocks or without.
    assert linear(torch.empty(0, 128)).shape == (0, 64)
    assert Linear(weight.clone())(torch.empty(0, 128)).shape == (0, 64)
    small, large = torch.randn(rows, 128), torch.randn(rows + 1, 128)
    assert torch.equal(linear(small), quant_linear(ops, small, q))
    torch.testing.assert_close(linear(large), large @ weight.T, rtol=1e-5, atol=1e-5)
    off_by_one_ulp = weight.clone()
    off_by_one_ulp.view(torch.int32)[5, 7] += 1
    assert Linear(off_by_one_ulp, quantized=q, kernels=ops).quantized is None
    # Columns that do not fill the kernel's groups stay dense; so do Q4_1 scales whose
    # product with a code would round (the kernel fuses d * q + m into one rounding).
    odd = random_blocks(ops.vec_size + 2, 128, "Q4_1", seed=5)
    assert Linear(odd.dequantize(), quantized=odd, kernels=ops).quantized is None
    fine_scales = QuantizedMatrix(q.scales * (1 + 2 ** -20), q.mins, q.quants)
    assert Linear(fine_scales.dequantize(), quantized=fine_scales, kernels=ops).quantized is None


def test_a_bf16_linear_reads_rounded_blocks_for_small_batches() -> None:
    # Beside oneDNN's bf16 GEMM up to 8 rows where the kernel sums bf16 pairs
    # (AVX512-BF16), else 4; up to 256 where the CPU has no bf16 GEMM and the dense path
    # multiplies in fp32; none beside the AMX kernel (test_amx_linear.py), which reads the
    # dense weights as fast.
    ops = require_cpu_ops()
    q = random_blocks(64, 128, "Q4_1", seed=6)
    weight = q.dequantize().to(torch.bfloat16)
    linear = Linear(weight.clone(), quantized=q, kernels=ops)
    if ops.amx_linear_supported():
        assert linear.quantized is None and linear.forward == linear._amx
        return
    assert linear.quantized is not None and linear.quantized.bf16
    native = linear.forward == linear._prepacked
    in_pairs = ops.quant_linear_bf16_dot_supported()
    assert linear.max_block_rows == (QUANTIZED_MAX_ROWS if not native else
                                     QUANTIZED_MAX_ROWS_BF16_DOT if in_pairs else
                                     QUANTIZED_MAX_ROWS_BF16_GEMM)
    generator = torch.Generator().manual_seed(7)
    for rows in (linear.max_block_rows, linear.max_block_rows + 1):
        x = torch.randn(rows, 128, generator=generator).to(torch.bfloat16)
        want = (x.double() @ weight.double().T).to(torch.bfloat16)
        torch.testing.assert_close(linear(x).float(), want.float(), rtol=1e-2, atol=1e-2)
        expected = (quant_linear(ops, x, q, bf16=True).to(torch.bfloat16)
                    if rows <= linear.max_block_rows else linear.forward(x))
        assert torch.equal(linear(x), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_linear_accumulates_in_fp32_on_any_cpu(dtype: torch.dtype) -> None:
    # Whether this CPU packs 16-bit weights or Linear multiplies their (exact) fp32 values.
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(5, 64, generator=generator).to(dtype)
    y = Linear(weight, bias)(x)
    want = (x.double() @ weight.double().T + bias.double()).to(dtype)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), want.float(), rtol=1e-2, atol=1e-2)
