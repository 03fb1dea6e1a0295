"""quant_linear (kernels/cpu/quant_linear.cpp) on random GGUF Q4_1 and Q8_0 blocks: it
expands them to exactly the values gguf's dequantizer gives, its products match a dense
matmul over those values, and a row's result does not depend on the rows beside it; and
Linear reads the blocks only for small batches and only when they are the loaded weight, and
accumulates 16-bit products in fp32 whether or not the CPU has a 16-bit GEMM."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.worker.models.quantized import QuantizedMatrix
from services.worker.models.layers import QUANTIZED_MAX_ROWS, Linear
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
    q = random_blocks(6, 96, kind)
    want = gguf_dequantize(q)
    assert np.array_equal(q.dequantize().numpy(), want)
    # One-hot rows pick single weights: y = I W^T = W^T, with no rounding in between.
    got = ops.quant_linear(torch.eye(96), q.scales, q.mins, q.quants)
    assert np.array_equal(got.numpy(), want.T)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0"])
def test_products_match_a_dense_matmul_and_are_batch_invariant(kind: str, threads: int) -> None:
    ops = require_cpu_ops()
    q = random_blocks(70, 160, kind, seed=1)
    weight = torch.from_numpy(gguf_dequantize(q))
    x = torch.randn(9, 160, generator=torch.Generator().manual_seed(2))
    with num_threads(threads):
        y = ops.quant_linear(x, q.scales, q.mins, q.quants)
        alone = [ops.quant_linear(x[i:i + 1], q.scales, q.mins, q.quants) for i in range(9)]
    want = (x.double() @ weight.double().T).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(y[i:i + 1], row) for i, row in enumerate(alone))


def test_linear_reads_blocks_for_small_batches_only_and_only_if_they_are_its_weight() -> None:
    ops = require_cpu_ops()
    q = random_blocks(64, 128, "Q4_1", seed=3)
    weight = q.dequantize()
    linear = Linear(weight.clone(), quantized=q, kernels=ops)
    assert linear.quantized is q
    small, large = torch.randn(QUANTIZED_MAX_ROWS, 128), torch.randn(QUANTIZED_MAX_ROWS + 1, 128)
    assert torch.equal(linear(small), ops.quant_linear(small, q.scales, q.mins, q.quants))
    torch.testing.assert_close(linear(large), large @ weight.T, rtol=1e-5, atol=1e-5)
    off_by_one_ulp = weight.clone()
    off_by_one_ulp.view(torch.int32)[5, 7] += 1
    assert Linear(off_by_one_ulp, quantized=q, kernels=ops).quantized is None


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
