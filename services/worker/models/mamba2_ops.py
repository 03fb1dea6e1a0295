"""The pure torch pieces of a Mamba2 mixer: causal depthwise conv, the SSD scan, gated RMSNorm.

Plain torch with fp32 math: the reference the kernels are checked against, and the CPU path.
Each function takes one sequence's tokens (prefill) or one token of many sequences (decode) with
the state it continues from, and returns the state it leaves, so the caller decides where
states live (slots of a pool, mamba2.py).

The SSD scan, per head h with dt' = clamp(softplus(dt + dt_bias)) and a = dt' * A (< 0):
    state_t = exp(a_t) * state_{t-1} + dt'_t * x_t ⊗ B_t      y_t = state_t · C_t + D * x_t
computed chunk by chunk (Mamba2's state-space duality): inside a chunk the outputs are a masked
"attention" C_i · B_j * exp(a_{j+1} + ... + a_i) over the chunk's tokens, plus the state the
chunk starts from decayed to each token; one state is carried between chunks. Exact up to fp32
rounding, whatever the chunk size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens x [L, C] through a causal depthwise conv (weight [C, K]) and SiLU,
    continuing from conv_state [C, K-1] (the K-1 inputs before x, zeros at the start).
    Returns (out [L, C] in x's dtype, the state after x [C, K-1])."""
    width = weight.shape[1]
    inputs = torch.cat([conv_state.float(), x.float().T], dim=1)           # [C, K-1+L]
    out = F.conv1d(inputs[None], weight.float()[:, None, :],
                   None if bias is None else bias.float(), groups=weight.shape[0])[0]
    return F.silu(out).T.to(x.dtype), inputs[:, inputs.shape[1] - (width - 1):]


def causal_conv1d_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence, x [N, C], against each one's conv_states [N, C, K-1].
    Returns (out [N, C] in x's dtype, the states after it [N, C, K-1])."""
    inputs = torch.cat([conv_states.float(), x.float()[:, :, None]], dim=2)   # [N, C, K]
    out = (inputs * weight.float()).sum(dim=2)
    if bias is not None:
        out = out + bias.float()
    return F.silu(out).to(x.dtype), inputs[:, :, 1:]


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float]) -> torch.Tensor:
    """dt' = clamp(softplus(dt + dt_bias), dt_limit), fp32 [L, H]."""
    return F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, ssm_state: torch.Tensor,
             chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's SSD scan: x [L, H, P], dt [L, H] (already dt'), A and D [H], B and C
    [L, G, S], continuing from ssm_state [H, P, S]. Returns (y [L, H, P] fp32, the state
    after the last token [H, P, S] fp32)."""
    num_heads = x.shape[1]
    x, B, C = (t.float() for t in (x, B, C))
    B = B.repeat_interleave(num_heads // B.shape[1], dim=1)                 # [L, H, S]
    C = C.repeat_interleave(num_heads // C.shape[1], dim=1)
    state = ssm_state.float()
    ys = []
    for start in range(0, x.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        y, state = _ssd_chunk(x[chunk], dt[chunk], A.float(), B[chunk], C[chunk], state)
        ys.append(y)
    return torch.cat(ys) + D.float()[:, None] * x, state


def _ssd_chunk(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of l tokens (x [l, H, P], dt [l, H], B and C [l, H, S]) from `state`
    [H, P, S]: (y [l, H, P] without the D skip, the state after the chunk)."""
    log_decay = (dt * A).T                                                  # [H, l]
    # decay[h, i, j] = exp(a_{j+1} + ... + a_i) for j <= i, 0 above the diagonal.
    # NOTE: each entry is its own masked cumulative sum, not a difference of two prefix sums:
    # over a long chunk those sums grow large and their difference loses fp32 precision.
    num_tokens = x.shape[0]
    lower = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=x.device).tril()
    # terms[h, k, j] = a_k for k > j: summed over k <= i, each (i, j) gets its own a_{j+1..i}.
    terms = log_decay[:, :, None].expand(-1, -1, num_tokens).masked_fill(~lower.tril(-1), 0.0)
    segment_sums = terms.cumsum(dim=1).masked_fill(~lower, float("-inf"))
    decay = segment_sums.exp()                                              # [H, l(i), l(j)]
    dt_x = dt[:, :, None] * x                                               # [l, H, P]
    scores = torch.einsum("ihs,jhs->hij", C, B) * decay
    y = torch.einsum("hij,jhp->ihp", scores, dt_x)
    # The incoming state, decayed to each token: exp(a_1 + ... + a_i) * (state · C_i).
    decay_from_start = log_decay.cumsum(dim=1).exp()                        # [H, l]
    y = y + torch.einsum("ihs,hps->ihp", C, state) * decay_from_start.T[:, :, None]
    # The state after the chunk: the old one decayed through it, plus each token's update
    # decayed from its position to the end (the last row of `decay`).
    decay_to_end = decay[:, -1, :]                                          # [H, l]
    new_state = (state * decay_from_start[:, -1, None, None]
                 + torch.einsum("jh,jhp,jhs->hps", decay_to_end.T, dt_x, B))
    return y, new_state


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, num_groups: int,
                   eps: float, dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of y * silu(gate) over each of num_groups equal groups of the last dim (Mamba2's
    norm_before_gate=False), scaled by weight; out in `dtype`."""
    gated = y.float() * F.silu(gate.float())
    grouped = gated.view(*gated.shape[:-1], num_groups, -1)
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.view(gated.shape).to(dtype)
