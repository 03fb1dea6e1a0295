"""The fused MoE op: torch reference against the definition, Triton kernel (compiled on CUDA,
the interpreter on CPU) against the reference, and the pair alignment the kernel's grid rests
on."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_reference import ref_fused_moe
from tests.kernels.harness import json_cases
from tests.kernels.moe_cases import CASES, loop_moe, make_inputs


def _tolerance(dtype: torch.dtype) -> float:
    return 3e-2 if dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("name,tokens,hidden,inter,experts,top_k,dtype", CASES,
                         ids=[c[0] for c in CASES])
def test_reference_matches_per_token_loop(name, tokens, hidden, inter, experts, top_k,
                                          dtype) -> None:
    inputs = make_inputs(tokens, hidden, inter, experts, top_k, dtype)
    got = ref_fused_moe(*inputs)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    want = loop_moe(*inputs)
    assert (got.float() - want).abs().max() <= _tolerance(dtype) * max(1.0, want.abs().max())


def test_align_pairs_by_expert_pads_each_group() -> None:
    from kernels.triton_fused_moe import align_pairs_by_expert

    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])   # pairs 0..5 -> experts 2,0,2,1,0,2
    sorted_pairs, block_experts = align_pairs_by_expert(ids, num_experts=4, block_m=4)
    # Sized for the worst case, cdiv(6 + 4 * 3, 4) = 5 blocks; expert 3 has no pair, and the
    # blocks past the last group are padding only.
    assert block_experts.tolist()[:3] == [0, 1, 2]
    assert sorted_pairs.tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6] + [6] * 8


def test_triton_fused_moe_matches_reference() -> None:
    results = json_cases("tests.kernels.moe_cases")
    assert set(results) == {c[0] for c in CASES}
    for name, *_, dtype in CASES:
        assert results[name]["shape_ok"], name
        assert results[name]["err"] <= _tolerance(dtype), (name, results[name])
