"""Fused MoE: the Triton kernel against the torch reference, and the reference against a
per-token loop. Runnable as `python -m tests.kernels.moe_cases`: runs the kernel on
KERNEL_TEST_DEVICE (compiled on CUDA, TRITON_INTERPRET=1 on CPU) and prints one JSON line of
max error per case (harness.json_cases runs it in a subprocess)."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from kernels.moe_reference import ref_fused_moe
from tests.kernels.harness import DEVICE

# (name, tokens, hidden, intermediate, experts, top_k, dtype)
CASES = [
    ("fp32_top2_of_4", 7, 32, 48, 4, 2, torch.float32),
    ("fp32_top1_of_3_unused_expert", 20, 64, 16, 3, 1, torch.float32),
    ("bf16_top4_of_8", 33, 32, 32, 8, 4, torch.bfloat16),
    ("fp32_single_token", 1, 32, 32, 6, 2, torch.float32),
]


def make_inputs(tokens: int, hidden: int, intermediate: int, experts: int, top_k: int,
                dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, intermediate, generator=gen) / intermediate**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    if experts == 3:
        logits[:, 2] = -100.0  # an expert no token picks
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, w13, w2, weights, ids


def loop_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token, expert by expert: the definition, in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e].float() @ x[t].float()
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, k] * (w2[e].float() @ act)
    return out


def _compare_triton_with_reference() -> None:
    from kernels import fused_moe

    for name, *shape, dtype in CASES:
        inputs = make_inputs(*shape, dtype)
        got = fused_moe(*(t.to(DEVICE) for t in inputs)).cpu()
        want = ref_fused_moe(*inputs)
        print(json.dumps({"case": name, "err": float((got.float() - want.float()).abs().max()),
                          "shape_ok": got.shape == want.shape}), flush=True)


if __name__ == "__main__":
    _compare_triton_with_reference()
    sys.exit(0)
