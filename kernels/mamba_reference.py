"""Torch reference of Mamba2's decode step (mamba_ssm's selective_state_update), the CPU path too.

    ref_selective_state_update(ssm_states, state_indices, x, dt, dt_bias, A, B, C, D,
                               dt_limit=(0.0, inf)) -> out [N, H, P]

One new token per sequence: sequence i reads and writes ssm_states[state_indices[i]]
([H, P, S] fp32 or the model dtype: heads, head dim, state size). With dt' = clamp(softplus(dt +
dt_bias), dt_limit) per head and g = the head's group (heads split evenly over G groups):

    state = exp(dt' * A) * state + dt' * x ⊗ B[g]        out = state · C[g] + D * x

x [N, H, P], dt [N, H], B and C [N, G, S]; A, D, dt_bias [H] (fp32). Math in fp32; out in x's dtype.
"""

import torch
import torch.nn.functional as F


def ref_selective_state_update(
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    num_heads, num_groups = x.shape[1], B.shape[1]
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(*dt_limit)          # [N, H]
    B = B.float().repeat_interleave(num_heads // num_groups, dim=1)          # [N, H, S]
    C = C.float().repeat_interleave(num_heads // num_groups, dim=1)
    xf = x.float()
    slots = state_indices.long()
    decay = torch.exp(dt * A.float())[:, :, None, None]                      # [N, H, 1, 1]
    state = (ssm_states[slots].float() * decay
             + (dt[:, :, None] * xf)[..., None] * B[:, :, None, :])          # [N, H, P, S]
    ssm_states[slots] = state.to(ssm_states.dtype)
    out = torch.einsum("nhps,nhs->nhp", state, C) + D.float()[:, None] * xf
    return out.to(x.dtype)
