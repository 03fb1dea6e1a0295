"""amx_linear (kernels/cpu/amx_linear.cpp), on CPUs with AMX-BF16 only: its products are a
bf16 GEMM's (fp32 sums of the bf16 products, rounded once), at shapes that leave partial
tiles in every direction, with and without a bias; a row's result does not depend on the
rows beside it nor on the thread count; and a bf16 Linear runs on it. amx_linear_silu_mul
(a gate_up projection with SiLU-and-mul in its epilogue) gives the bits of the two steps, and a
Llama layer's MLP takes it where it can."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from services.worker.models.layers import Linear
from tests.worker.cpu_kernels import num_threads, require_cpu_ops


def require_amx() -> ModuleType:
    ops = require_cpu_ops()
    if not ops.amx_linear_supported():
        pytest.skip("no AMX-BF16 on this CPU")
    return ops


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return (y if bias is None else y + bias.double()).to(torch.bfloat16)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n, k", [(48, 64), (40, 70), (16, 32), (33, 600)])
def test_products_are_a_bf16_gemm_at_every_tile_edge(n: int, k: int, with_bias: bool) -> None:
    ops = require_amx()
    generator = torch.Generator().manual_seed(n * k)
    weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    bias = torch.randn(n, generator=generator).to(torch.bfloat16) if with_bias else None
    packed = ops.amx_pack_bf16(weight)
    assert packed.shape == ((n + 15) // 16, (k + 31) // 32, 16, 32)
    for m in (1, 5, 16, 17, 32, 33, 70):
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
        y = ops.amx_linear(x, packed, n, bias)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        # One rounding to bf16 of sums that differ from float64's by fp32's error only.
        torch.testing.assert_close(y.float(), reference(x, weight, bias).float(),
                                   rtol=2 ** -7, atol=1e-3)


def test_one_hot_rows_pick_the_weights_exactly() -> None:
    ops = require_amx()
    weight = torch.randn(40, 70, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = ops.amx_linear(torch.eye(70, dtype=torch.bfloat16), ops.amx_pack_bf16(weight), 40)
    assert torch.equal(y, weight.T)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_the_rows_beside_it(threads: int) -> None:
    ops = require_amx()
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 576, generator=generator).to(torch.bfloat16)
    packed = ops.amx_pack_bf16(weight)
    x = torch.randn(40, 576, generator=generator).to(torch.bfloat16)
    with num_threads(threads):
        y = ops.amx_linear(x, packed, 96)
        alone = [ops.amx_linear(x[i:i + 1], packed, 96) for i in range(40)]
        leading = [ops.amx_linear(x[:m], packed, 96) for m in (2, 16, 17, 31, 33)]
    with num_threads(3 - threads):
        other_threads = ops.amx_linear(x, packed, 96)
    assert all(torch.equal(y[i:i + 1], row) for i, row in enumerate(alone))
    assert all(torch.equal(y[:len(part)], part) for part in leading)
    assert torch.equal(y, other_threads)


def test_an_empty_batch_is_empty_and_wrong_shapes_say_what_is_wrong() -> None:
    ops = require_amx()
    packed = ops.amx_pack_bf16(torch.ones(48, 64, dtype=torch.bfloat16))
    assert ops.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, 48).shape == (0, 48)
    with pytest.raises(RuntimeError, match="columns"):
        ops.amx_linear(torch.ones(2, 96, dtype=torch.bfloat16), packed, 48)
    with pytest.raises(RuntimeError, match="bf16"):
        ops.amx_linear(torch.ones(2, 64), packed, 48)
    with pytest.raises(RuntimeError, match="column tiles"):
        ops.amx_linear(torch.ones(2, 64, dtype=torch.bfloat16), packed, 80)


def test_a_bf16_linear_runs_on_amx() -> None:
    ops = require_amx()
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(96, 64, generator=generator).to(torch.bfloat16)
    bias = torch.randn(96, generator=generator).to(torch.bfloat16)
    linear = Linear(weight.clone(), bias, kernels=ops)
    for m in (1, 8, 32, 200):
        x = torch.randn(m, 64, generator=generator).to(torch.bfloat16)
        assert torch.equal(linear(x), ops.amx_linear(x, linear.amx_packed, 96, bias))


@pytest.mark.parametrize("n, k", [(3072, 576), (64, 40), (96, 100)])
def test_silu_mul_in_the_epilogue_gives_the_bits_of_the_two_steps(n: int, k: int) -> None:
    ops = require_amx()
    generator = torch.Generator().manual_seed(n + k)
    weight = (torch.randn(n, k, generator=generator) * 0.1).to(torch.bfloat16)
    packed = ops.amx_pack_bf16(weight)
    for m in (1, 5, 16, 17, 32, 33, 70, 160):
        x = torch.randn(m, k, generator=generator).to(torch.bfloat16)
        two_steps = ops.silu_and_mul(ops.amx_linear(x, packed, n))
        fused = ops.amx_linear_silu_mul(x, packed, n)
        assert fused.shape == (m, n // 2)
        assert torch.equal(fused.view(torch.int16), two_steps.view(torch.int16)), m


def test_silu_mul_needs_whole_tiles_of_gate_and_up() -> None:
    ops = require_amx()
    packed = ops.amx_pack_bf16(torch.ones(48, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.amx_linear_silu_mul(torch.ones(2, 64, dtype=torch.bfloat16), packed, 48)
    empty = ops.amx_linear_silu_mul(torch.empty(0, 64, dtype=torch.bfloat16),
                                    ops.amx_pack_bf16(torch.ones(64, 64, dtype=torch.bfloat16)),
                                    64)
    assert empty.shape == (0, 32)


def test_a_llama_mlp_fuses_silu_and_mul_only_where_it_may() -> None:
    ops = require_amx()
    generator = torch.Generator().manual_seed(4)
    gate_up = torch.randn(128, 64, generator=generator).to(torch.bfloat16)
    assert Linear(gate_up.clone(), kernels=ops).fuses_silu_and_mul
    # A bias, or halves that are not whole column tiles: the two steps.
    assert not Linear(gate_up.clone(), torch.ones(128, dtype=torch.bfloat16),
                      kernels=ops).fuses_silu_and_mul
    assert not Linear(gate_up[:80].clone(), kernels=ops).fuses_silu_and_mul
    assert not Linear(gate_up.float(), kernels=ops).fuses_silu_and_mul
