"""Sliding-window and soft-capped layers through the attention backends, against the reference.

Steps come from tests/worker/attention_cases.py (decodes, fresh prefills, chunks after a cached
context); each runs with a layer whose window is shorter than most of its contexts. Runnable
as `python -m tests.kernels.window_backend_cases` (see harness.json_cases): runs the triton
backend on KERNEL_TEST_DEVICE (compiled on CUDA, the interpreter on CPU) and prints one JSON
line of max error per case.
"""

from __future__ import annotations

import json
import sys

import torch

from kernels.reference import ref_paged_prefill_attention
from services.worker.attention.backend import AttentionBackend, AttentionLayer
from tests.kernels.harness import DEVICE
from tests.worker.attention_cases import (BLOCK_SIZE, AttentionCase, Step, make_step, step_on,
                                          unit_kv_cache)

# (case, window, soft-cap): windows shorter than a block and longer, one spanning blocks.
CASES = [
    (AttentionCase("mha_mixed_w8", 4, 4, [17, 40, 0, 33], [1, 1, 23, 9]), 8, None),
    (AttentionCase("gqa3_decode_w20_cap", 9, 3, [5, 15, 16, 100], [1, 1, 1, 1]), 20, 1.5),
    (AttentionCase("gqa4_prefill_w5_cap", 8, 2, [0, 31, 48], [70, 16, 3]), 5, 2.0),
    (AttentionCase("gqa2_bf16_w16", 4, 2, [20, 0, 7], [1, 30, 12], dtype=torch.bfloat16), 16,
     None),
    (AttentionCase("gqa2_global_cap", 4, 2, [20, 0, 7], [1, 30, 12]), None, 3.0),
    (AttentionCase("gqa3_bf16_decode_w20_cap", 9, 3, [5, 15, 16, 100], [1, 1, 1, 1],
                   dtype=torch.bfloat16), 20, 1.5),
    # Long decodes whose windows the CPU plan cuts into KV splits (with 2 threads); a prefill
    # tile whose rows' windows start in different key chunks.
    (AttentionCase("gqa3_long_decodes_w600", 9, 3, [2100, 700, 15], [1, 1, 1], head_dim=64),
     600, None),
    (AttentionCase("mha_long_prefill_w40_cap", 4, 4, [300], [77], head_dim=64), 40, 5.0),
    # The bf16-products prefill (AMX or AVX512-BF16) with both: a chunk after history.
    (AttentionCase("gqa3_bf16_prefill_w40_cap", 9, 3, [300, 0], [77, 45], dtype=torch.bfloat16,
                   head_dim=64), 40, 5.0),
]


def layer_of(case: AttentionCase, window: int | None, cap: float | None) -> AttentionLayer:
    return AttentionLayer(case.head_dim ** -0.5, window, cap)


def run_backend(backend_cls: type[AttentionBackend], case: AttentionCase, step: Step,
                layer: AttentionLayer) -> torch.Tensor:
    """The backend's output [T, Hq * D] for the step, on copies of its caches."""
    backend = backend_cls(case.num_heads, case.num_kv_heads, case.head_dim, 1.0, BLOCK_SIZE)
    kv_cache = unit_kv_cache(step)
    return backend.forward(step.query, step.key, step.value, kv_cache,
                           backend.build_metadata(step.common), layer)


def run_reference(step: Step, layer: AttentionLayer) -> torch.Tensor:
    """kernels.reference on the step (its K/V written first): [T, Hq * D]."""
    key_cache, value_cache = step.key_cache.clone(), step.value_cache.clone()
    flat = (-1, *key_cache.shape[2:])
    key_cache.view(flat)[step.common.slot_mapping] = step.key
    value_cache.view(flat)[step.common.slot_mapping] = step.value
    out = ref_paged_prefill_attention(
        step.query, key_cache, value_cache, step.common.block_table,
        step.common.query_start_loc, step.common.seq_lens, layer.scale,
        sliding_window=layer.sliding_window, logits_soft_cap=layer.logits_soft_cap)
    return out.reshape(out.shape[0], -1)


def _compare_triton_with_reference() -> None:
    from services.worker.attention.triton_attn import TritonAttentionBackend

    for case, window, cap in CASES:
        step, layer = make_step(case), layer_of(case, window, cap)
        got = run_backend(TritonAttentionBackend, case, step_on(step, DEVICE), layer).cpu()
        want = run_reference(step, layer)
        print(json.dumps({"case": case.name,
                          "err": float((got.float() - want.float()).abs().max())}), flush=True)


if __name__ == "__main__":
    _compare_triton_with_reference()
    sys.exit(0)
