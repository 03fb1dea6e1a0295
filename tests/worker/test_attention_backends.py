"""Attention backends against kernels.reference: writes, decodes, prefills, cached prefixes, GQA.

The torch backend runs in-process; the triton adapter runs in a subprocess, compiled on CUDA
and under the Triton interpreter on CPU (see tests/kernels/harness.py for why), and must agree
with the torch backend.
"""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.torch_attn import TorchAttentionBackend, _e4m3_to_bf16
from tests.kernels.harness import DEVICE, json_cases
from tests.kernels.paged_batch import GPU_DOT_TOLERANCE
from tests.worker.attention_cases import (CASES, AttentionCase, make_step, run_backend,
                                          run_reference)


def _tolerance(case: AttentionCase, device: str = "cpu") -> float:
    if case.fp8:
        return 0.15  # a fresh prefill attends to unquantized keys; the reference to e4m3 ones
    if device != "cpu":
        return GPU_DOT_TOLERANCE[case.dtype]
    return 2e-2 if case.dtype == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_torch_backend_matches_reference(case: AttentionCase) -> None:
    step = make_step(case)
    out, key_cache, value_cache = run_backend(TorchAttentionBackend, case, step)
    want, ref_k, ref_v = run_reference(case, step)
    assert torch.equal(key_cache.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(value_cache.view(torch.uint8), ref_v.view(torch.uint8))
    assert out.shape == (step.query.shape[0], case.num_heads * case.head_dim)
    err = (out.float() - want.reshape(out.shape).float()).abs().max().item()
    assert err <= _tolerance(case), err


def test_torch_backend_shares_metadata_across_layers() -> None:
    case = CASES[0]
    step = make_step(case)
    backend = TorchAttentionBackend(case.num_heads, case.num_kv_heads, case.head_dim,
                                    case.head_dim ** -0.5, 16)
    metadata = backend.build_metadata(step.common)
    assert metadata.num_decodes == 2 and len(metadata.prefills) == 2
    fresh, chunk = metadata.prefills
    assert fresh.block_ids is None and fresh.mask is None  # attends to its own keys
    assert chunk.mask.shape == (9, 42) and bool(chunk.mask[0, 33]) and not chunk.mask[0, 34]


def test_fp8_bytes_convert_exactly_to_bf16() -> None:
    raw = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8)
    want = raw.view(torch.float8_e4m3fn).to(torch.bfloat16)
    assert torch.equal(_e4m3_to_bf16(raw), want)


def test_triton_adapter_matches_torch_backend() -> None:
    results = json_cases("tests.worker.attention_cases")
    assert set(results) == {c.name for c in CASES}
    for case in CASES:
        assert results[case.name]["cache"] == 0.0, case.name
        assert results[case.name]["out"] <= _tolerance(case, DEVICE), (case.name,
                                                                        results[case.name])
