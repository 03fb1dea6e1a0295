"""The batched LoRA op on the GPU (Punica's BGMV): every row takes its own adapter's update,

    y[t] += scales[s] * (x[t] @ lora_a[s]^T) @ lora_b[s]^T   with s = token_slots[t] (-1: none)

in two launches, as Punica splits it: shrink (x [T, K] -> fp32 [T, R], scaled) and expand
(that [T, R] -> added to y [T, N]), both one gathered matrix-vector kernel. One program per
(row, tile of outputs) reads its row's slot's matrix, so rows of different adapters mix freely
in one launch; base rows exit.
Layouts as the torch reference (services/worker/lora/ops.py): lora_a [S, R, K], lora_b
[S, N, R], scales fp32 [S], token_slots int32 [T].
NOTE: matrix-vector products (tl.sum over a broadcast), not tl.dot: one row per program has no
16-row tile to feed a dot, and it runs under the interpreter as on a GPU. A prefill's many rows
of one adapter re-read its tiles (from L2); Punica's SGMV (rows grouped by slot, tl.dot over
row tiles) is the faster form for long prefills.
"""

import torch
import triton
import triton.language as tl

from kernels.launch_device import launch_device

BLOCK_OUT = 64
BLOCK_IN = 64


@triton.jit
def _gathered_gemv_kernel(v_ptr, w_ptr, slots_ptr, scales_ptr, out_ptr, n_out, n_in,
                          stride_vm, stride_ws, stride_wo, stride_om,
                          SCALE: tl.constexpr, ACCUMULATE: tl.constexpr,
                          BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr):
    """out[t, o] (+)= (scales[s] *) sum_i w[s, o, i] * v[t, i] with s = slots[t]; one program
    per (row, tile of o). Shrink: v = x, w = lora_a, scaled; expand: v = the shrunk rows,
    w = lora_b, added to y."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        offs_o = tl.program_id(1) * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
        mask_o = offs_o < n_out
        acc = tl.zeros([BLOCK_OUT], dtype=tl.float32)
        for i0 in range(0, n_in, BLOCK_IN):
            offs_i = i0 + tl.arange(0, BLOCK_IN)
            mask_i = offs_i < n_in
            v = tl.load(v_ptr + row * stride_vm + offs_i, mask=mask_i, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + slot * stride_ws + offs_o[:, None] * stride_wo + offs_i[None, :],
                        mask=mask_o[:, None] & mask_i[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(w * v[None, :], axis=1)
        if SCALE:
            acc *= tl.load(scales_ptr + slot)
        out_ptrs = out_ptr + row * stride_om + offs_o
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=mask_o, other=0.0).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_o)


def lora_add(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scales: torch.Tensor, token_slots: torch.Tensor) -> None:
    """Adds each row's LoRA update to y [T, N] in place (x [T, K])."""
    num_tokens, k = x.shape
    num_slots, r, _ = lora_a.shape
    n = lora_b.shape[1]
    assert lora_a.shape[2] == k and lora_b.shape == (num_slots, n, r), (lora_a.shape,
                                                                         lora_b.shape)
    assert y.shape == (num_tokens, n) and y.stride(1) == 1 and token_slots.shape == (num_tokens,)
    if num_tokens == 0:
        return
    assert lora_b.stride(2) == 1   # any slot and row strides (LoraLinear's is a view)
    x, lora_a = x.contiguous(), lora_a.contiguous()
    shrunk = torch.empty(num_tokens, r, dtype=torch.float32, device=x.device)
    _gathered_gemv(x, lora_a, token_slots, scales, shrunk, is_expand=False)
    _gathered_gemv(shrunk, lora_b, token_slots, scales, y, is_expand=True)


def _gathered_gemv(v: torch.Tensor, w: torch.Tensor, token_slots: torch.Tensor,
                   scales: torch.Tensor, out: torch.Tensor, is_expand: bool) -> None:
    num_tokens, n_out = out.shape
    with launch_device(out):
        _gathered_gemv_kernel[(num_tokens, triton.cdiv(n_out, BLOCK_OUT))](
            v, w, token_slots, scales, out, n_out, v.shape[1],
            v.stride(0), w.stride(0), w.stride(1), out.stride(0),
            SCALE=not is_expand, ACCUMULATE=is_expand, BLOCK_OUT=BLOCK_OUT, BLOCK_IN=BLOCK_IN)
