"""The batched LoRA op: the CPU paths (services/worker/lora/ops.py) and the Triton kernels
(kernels/triton_lora.py) against the torch reference. The Triton cases, at small shapes, run
compiled on CUDA and under the interpreter on CPU: rows of several slots and base rows mixed,
shapes off the tile sizes (masked edges), slots zero-padded past their rank, bf16, a single row.
Runnable as `python -m tests.kernels.test_triton_lora` (on KERNEL_TEST_DEVICE): one JSON line
per case. The pytest test runs that in a subprocess (tests/kernels/harness.py says why).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from services.worker.lora.ops import (SEGMENT_MIN_ROWS, LoraBatch, grouped_lora_add,
                                      masked_lora_add, ref_lora_add, segment_lora_add)
from tests.kernels.harness import DEVICE, json_cases
from tests.kernels.test_triton_w4a16 import error_in_bounds

# (name, rows, K, N, slots, max rank, dtype)
CASES = [
    ("mixed_fp32", 9, 64, 48, 3, 16, torch.float32),
    ("off_tiles_fp32", 7, 72, 40, 4, 24, torch.float32),
    ("mixed_bf16", 6, 64, 80, 2, 16, torch.bfloat16),
    ("one_row_fp32", 1, 64, 32, 2, 8, torch.float32),
]


def make_inputs(rows: int, k: int, n: int, num_slots: int, max_rank: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """y, x, lora_a, lora_b (slot s zero past rank max_rank - 4 s, at least 4), fp32 scales,
    token slots with every slot and some base rows (-1)."""
    gen = torch.Generator().manual_seed(rows * k + n)
    lora_a = torch.randn(num_slots, max_rank, k, generator=gen)
    lora_b = torch.randn(num_slots, n, max_rank, generator=gen)
    for slot, rank in enumerate(slot_ranks(num_slots, max_rank)):
        lora_a[slot, rank:] = 0
        lora_b[slot, :, rank:] = 0
    scales = torch.rand(num_slots, generator=gen) + 0.5
    token_slots = torch.randint(-1, num_slots, (rows,), generator=gen, dtype=torch.int32)
    token_slots[:min(rows, num_slots)] = torch.arange(min(rows, num_slots), dtype=torch.int32)
    y, x = torch.randn(rows, n, generator=gen), torch.randn(rows, k, generator=gen)
    return (y.to(dtype), x.to(dtype), lora_a.to(dtype), lora_b.to(dtype), scales, token_slots)


def slot_ranks(num_slots: int, max_rank: int) -> list[int]:
    return [max(4, max_rank - 4 * slot) for slot in range(num_slots)]


def _loop_reference(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor,
                    lora_b: torch.Tensor, scales: torch.Tensor,
                    token_slots: torch.Tensor) -> torch.Tensor:
    """The op's definition, row by row."""
    out = y.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            out[t] += scales[slot] * (lora_b[slot] @ (lora_a[slot] @ x[t]))
    return out


def test_reference_is_the_definition() -> None:
    y, x, lora_a, lora_b, scales, token_slots = make_inputs(*CASES[0][1:])
    want = _loop_reference(y, x, lora_a, lora_b, scales, token_slots)
    ref_lora_add(y, x, lora_a, lora_b, scales, token_slots)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4)


def test_grouped_cpu_path_matches_reference() -> None:
    for name, *shape, dtype in CASES:
        if dtype != torch.float32:
            continue
        y, x, lora_a, lora_b, scales, token_slots = make_inputs(*shape, dtype)
        for slots in (token_slots, torch.full_like(token_slots, 1)):   # mixed, then one slot
            batch = LoraBatch.from_slots(slots.numpy(), scales.tolist(), torch.device("cpu"))
            grouped, masked, want = y.clone(), y.clone(), y.clone()
            grouped_lora_add(grouped, x, lora_a, lora_b, scales.tolist(),
                             slot_ranks(*shape[3:]), batch.groups)
            onehot = (slots[:, None] == torch.arange(shape[3])).float()
            num_slots, rank, in_features = lora_a.shape
            masked_lora_add(masked, x, lora_a.reshape(num_slots * rank, in_features).t(),
                            lora_b.permute(1, 0, 2).reshape(-1, num_slots * rank).t(),
                            (onehot * scales)[:, :, None])
            ref_lora_add(want, x, lora_a, lora_b, scales, slots)
            assert error_in_bounds(grouped, want, dtype) <= 1, name
            assert error_in_bounds(masked, want, dtype) <= 1, name


def test_segment_cpu_path_matches_reference() -> None:
    """Prefill chunks (runs of SEGMENT_MIN_ROWS rows or more, of an adapter or the base)
    between decodes of several adapters."""
    query_lens = np.array([20, 1, 1, SEGMENT_MIN_ROWS, 1, 17, 1])
    request_slots = np.array([0, 2, -1, 1, 0, -1, 1], dtype=np.int32)
    token_slots = np.repeat(request_slots, query_lens)
    num_slots, max_rank = 3, 16
    y, x, lora_a, lora_b, scales, _ = make_inputs(len(token_slots), 64, 48, num_slots,
                                                  max_rank, torch.float32)
    batch = LoraBatch.from_slots(token_slots, scales.tolist(), torch.device("cpu"), query_lens)
    assert batch.segments == ((0, 20, 0), (22, 22 + SEGMENT_MIN_ROWS, 1))
    got, want = y.clone(), y.clone()
    segment_lora_add(got, x, lora_a, lora_b, scales.tolist(), slot_ranks(num_slots, max_rank),
                     lora_a.reshape(num_slots * max_rank, -1).t(),
                     lora_b.permute(1, 0, 2).reshape(-1, num_slots * max_rank).t(), batch)
    ref_lora_add(want, x, lora_a, lora_b, scales, torch.from_numpy(token_slots))
    assert error_in_bounds(got, want, torch.float32) <= 1


def test_batch_groups_rows_by_slot() -> None:
    cpu = torch.device("cpu")
    batch = LoraBatch.from_slots(np.array([2, -1, 0, 2], dtype=np.int32), [0.5, 1.0, 2.0], cpu)
    assert [(slot, rows.tolist()) for slot, rows in batch.groups] == [(0, [2]), (2, [0, 3])]
    assert batch.row_scales is not None
    assert batch.row_scales[:, :, 0].tolist() == [[0, 0, 2], [0, 0, 0], [0.5, 0, 0], [0, 0, 2]]
    one = LoraBatch.from_slots(np.array([1, 1], dtype=np.int32), [0.5, 1.0, 2.0], cpu)
    assert one.groups == ((1, None),) and one.row_scales is None   # every row: one addmm


def _compare_triton_with_reference() -> None:
    from kernels.triton_lora import lora_add

    for name, *shape, dtype in CASES:
        y, x, lora_a, lora_b, scales, token_slots = make_inputs(*shape, dtype)
        want = y.clone()
        ref_lora_add(want, x, lora_a, lora_b, scales, token_slots)
        base_rows = token_slots < 0
        lora_b_view = lora_b.permute(1, 0, 2).contiguous().permute(1, 0, 2)   # LoraLinear's
        y_dev = y.to(DEVICE)
        lora_add(y_dev, x.to(DEVICE), lora_a.to(DEVICE), lora_b_view.to(DEVICE),
                 scales.to(DEVICE), token_slots.to(DEVICE))
        got = y_dev.cpu()
        print(json.dumps({"case": name, "dtype_ok": got.dtype == dtype,
                          "base_rows_kept": bool(torch.equal(got[base_rows], want[base_rows])),
                          "err": error_in_bounds(got.float(), want.float(), dtype)}), flush=True)


def test_triton_lora_matches_reference() -> None:
    results = json_cases("tests.kernels.test_triton_lora")
    assert set(results) == {c[0] for c in CASES}
    for result in results.values():
        assert result["dtype_ok"] and result["base_rows_kept"] and result["err"] <= 1, result


if __name__ == "__main__":
    _compare_triton_with_reference()
