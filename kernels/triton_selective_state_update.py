"""Mamba2's decode step on the GPU: one token per sequence updates its slot's SSM state in place.

    selective_state_update(ssm_states, state_indices, x, dt, dt_bias, A, B, C, D,
                           dt_limit=(0.0, inf)) -> out [N, H, P]

Same contract and layouts as the torch reference (kernels/mamba_reference.py). One program per
(sequence, head, tile of head dim) loads its [BLOCK_P, S] tile of the state once, decays it,
adds dt * x ⊗ B, stores it back and reduces it against C: the state is read and written once,
which is all a decode step of a Mamba layer costs in memory traffic.
NOTE: matrix-vector work (tl.sum over a broadcast), not tl.dot: a single token has no 16-row
tile to feed a dot, and it runs the same under the interpreter as on a GPU.
"""

import torch
import triton
import triton.language as tl

from kernels.launch_device import launch_device

BLOCK_P = 16


@triton.jit
def _selective_state_update_kernel(
        state_ptr, indices_ptr, x_ptr, dt_ptr, dt_bias_ptr, a_ptr, b_ptr, c_ptr, d_ptr, out_ptr,
        head_dim, state_size, heads_per_group, dt_min, dt_max,
        stride_state_slot, stride_state_head, stride_state_p,
        stride_x_seq, stride_x_head, stride_dt_seq, stride_b_seq, stride_b_group,
        stride_c_seq, stride_c_group, stride_out_seq, stride_out_head,
        BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    group = head // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < head_dim
    mask_s = offs_s < state_size
    mask = mask_p[:, None] & mask_s[None, :]

    slot = tl.load(indices_ptr + seq).to(tl.int64)
    state_ptrs = (state_ptr + slot * stride_state_slot + head * stride_state_head
                  + offs_p[:, None] * stride_state_p + offs_s[None, :])
    state = tl.load(state_ptrs, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + seq * stride_x_seq + head * stride_x_head + offs_p, mask=mask_p,
                other=0.0).to(tl.float32)
    b = tl.load(b_ptr + seq * stride_b_seq + group * stride_b_group + offs_s, mask=mask_s,
                other=0.0).to(tl.float32)
    c = tl.load(c_ptr + seq * stride_c_seq + group * stride_c_group + offs_s, mask=mask_s,
                other=0.0).to(tl.float32)

    dt = tl.load(dt_ptr + seq * stride_dt_seq + head).to(tl.float32)
    dt += tl.load(dt_bias_ptr + head).to(tl.float32)
    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)   # torch's softplus threshold
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(a_ptr + head).to(tl.float32))

    state = state * decay + (dt * x)[:, None] * b[None, :]
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
    out = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x
    tl.store(out_ptr + seq * stride_out_seq + head * stride_out_head + offs_p,
             out.to(out_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update(
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
    num_seqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1], B.shape[2]
    assert ssm_states.shape[1:] == (num_heads, head_dim, state_size), ssm_states.shape
    assert ssm_states.stride(3) == 1 and x.stride(2) == 1 and dt.stride(1) == 1
    assert B.stride(2) == 1 and C.stride(2) == 1 and num_heads % num_groups == 0
    out = torch.empty_like(x)
    if num_seqs == 0:
        return out
    grid = (num_seqs, num_heads, triton.cdiv(head_dim, BLOCK_P))
    with launch_device(x):
        _selective_state_update_kernel[grid](
            ssm_states, state_indices, x, dt, dt_bias, A, B, C, D, out,
            head_dim, state_size, num_heads // num_groups, float(dt_limit[0]),
            float(dt_limit[1]),
            ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
            x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1),
            C.stride(0), C.stride(1), out.stride(0), out.stride(1),
            BLOCK_P=BLOCK_P, BLOCK_S=triton.next_power_of_2(state_size))
    return out
