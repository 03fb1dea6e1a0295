"""Sliding windows and soft-caps in the torch, CPU-kernel and triton attention backends."""

from __future__ import annotations

import pytest
import torch

from services.worker.attention.cpu_attn import CpuAttentionBackend
from services.worker.attention.torch_attn import TorchAttentionBackend
from tests.kernels.harness import DEVICE, json_cases
from tests.kernels.paged_batch import GPU_DOT_TOLERANCE
from tests.kernels.window_backend_cases import (
    CASES,
    layer_of,
    make_step,
    run_backend,
    run_reference,
)
from tests.worker.cpu_kernels import num_threads, require_cpu_ops

IDS = [case.name for case, _, _ in CASES]


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-5


@pytest.mark.parametrize("case,window,cap", CASES, ids=IDS)
def test_torch_backend_windows_and_caps(case, window, cap) -> None:
    step, layer = make_step(case), layer_of(case, window, cap)
    want = run_reference(step, layer)
    got = run_backend(TorchAttentionBackend, case, step, layer)
    assert (got.float() - want.float()).abs().max() <= _tolerance(case.dtype)
    # The window (or cap) changes the result: the reference without it differs.
    plain = run_reference(step, layer_of(case, None, None))
    assert (plain.float() - want.float()).abs().max() > 10 * _tolerance(case.dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case,window,cap", CASES, ids=IDS)
def test_cpu_kernel_backend_windows_and_caps(case, window, cap, threads: int) -> None:
    require_cpu_ops()
    step, layer = make_step(case), layer_of(case, window, cap)
    with num_threads(threads):
        got = run_backend(CpuAttentionBackend, case, step, layer)
    want = run_reference(step, layer)
    assert (got.float() - want.float()).abs().max() <= _tolerance(case.dtype)


def test_torch_backend_builds_window_masks_once_per_step() -> None:
    case, window, _ = CASES[0]
    step = make_step(case)
    backend = TorchAttentionBackend(case.num_heads, case.num_kv_heads, case.head_dim, 1.0, 16)
    metadata = backend.build_metadata(step.common)
    masks = metadata.window_masks(window)
    assert metadata.window_masks(window) is masks
    # The chunk after 33 cached tokens: query 0 (position 33) sees keys 26..33 only.
    assert masks.chunk_masks[1][0].nonzero().flatten().tolist() == list(range(26, 34))


def test_triton_adapter_windows_and_caps() -> None:
    results = {name: r["err"] for name, r in
               json_cases("tests.kernels.window_backend_cases").items()}
    assert set(results) == set(IDS)
    for case, _, _ in CASES:
        tolerance = (GPU_DOT_TOLERANCE[case.dtype] if DEVICE != "cpu"
                     else _tolerance(case.dtype))
        assert results[case.name] <= tolerance, (case.name, results[case.name])
