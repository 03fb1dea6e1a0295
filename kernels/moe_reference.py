"""Torch reference of the fused mixture-of-experts op, grouped by expert (the CPU path too).

    ref_fused_moe(hidden, w13, w2, topk_weights, topk_ids) -> [T, H]

hidden [T, H]; w13 [E, 2I, H] holds each expert's gate rows then its up rows, w2 [E, H, I] its
down projection; topk_weights [T, K] (fp32) and topk_ids [T, K] say which K experts each token
goes to and how much each counts. out[t] = sum_k w[t, k] * down_e(silu(gate_e(x)) * up_e(x))
with e = topk_ids[t, k]: the token-expert pairs are grouped by expert, so each expert runs two
matmuls over all of its tokens (HF's loop, without its one-hot mask).
"""

import torch
import torch.nn.functional as F


def ref_fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    num_tokens, top_k = topk_ids.shape
    intermediate = w2.shape[2]
    out = torch.zeros_like(hidden)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs t * K + k, grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(hidden[tokens], w13[expert])
        act = F.silu(gate_up[:, :intermediate]) * gate_up[:, intermediate:]
        expert_out = F.linear(act, w2[expert]) * topk_weights.reshape(-1)[pairs, None]
        out.index_add_(0, tokens, expert_out.to(out.dtype))
    return out
