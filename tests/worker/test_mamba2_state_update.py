"""Mamba2's decode step: the torch reference (kernels/mamba_reference.py) against the recurrence
written out per sequence, and the Triton kernel (kernels/triton_selective_state_update.py)
against the reference, at small shapes: heads over several groups, a head dim and state size off
the tile sizes (masked edges), slots taken out of order with one left untouched, bf16 inputs
over an fp32 state, a dt limit; x, B and C reach the kernel as the mixer passes them, strided
views of one projection. Runnable as `python -m tests.worker.test_mamba2_state_update`
(on KERNEL_TEST_DEVICE): one JSON line per case; the pytest test runs that in a subprocess under
TRITON_INTERPRET=1 on CPU (tests/kernels/harness.py says why).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from kernels.mamba_reference import ref_selective_state_update
from tests.kernels.harness import DEVICE, json_cases

# (name, seqs, heads, groups, head_dim, state_size, input dtype, dt_limit)
CASES = [
    ("fp32_two_groups", 3, 4, 2, 16, 16, torch.float32, (0.0, float("inf"))),
    ("fp32_off_tiles", 2, 6, 3, 12, 10, torch.float32, (0.0, float("inf"))),
    ("bf16_one_group_dt_limit", 4, 4, 1, 16, 32, torch.bfloat16, (0.05, 0.5)),
    ("fp32_single_seq", 1, 2, 1, 24, 8, torch.float32, (0.0, float("inf"))),
]
NUM_SLOTS = 6


def make_inputs(seqs: int, heads: int, groups: int, head_dim: int, state_size: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """ssm_states (fp32, NUM_SLOTS), state_indices (reversed, skipping slot 0), x, dt, dt_bias,
    A, B, C, D."""
    gen = torch.Generator().manual_seed(seqs * heads + head_dim)
    ssm_states = torch.randn(NUM_SLOTS, heads, head_dim, state_size, generator=gen)
    state_indices = torch.arange(seqs, 0, -1, dtype=torch.int32)
    x = torch.randn(seqs, heads, head_dim, generator=gen).to(dtype)
    dt = torch.randn(seqs, heads, generator=gen).to(dtype)
    dt_bias = torch.randn(heads, generator=gen)
    A = -torch.rand(heads, generator=gen) * 4
    B = torch.randn(seqs, groups, state_size, generator=gen).to(dtype)
    C = torch.randn(seqs, groups, state_size, generator=gen).to(dtype)
    D = torch.randn(heads, generator=gen)
    return ssm_states, state_indices, x, dt, dt_bias, A, B, C, D


def _loop_reference(ssm_states, state_indices, x, dt, dt_bias, A, B, C, D,
                    dt_limit) -> torch.Tensor:
    """The recurrence head by head, sequence by sequence."""
    heads_per_group = x.shape[1] // B.shape[1]
    out = torch.empty(x.shape)
    for i, slot in enumerate(state_indices.tolist()):
        for h in range(x.shape[1]):
            g = h // heads_per_group
            step = F.softplus(dt[i, h].float() + dt_bias[h]).clamp(*dt_limit)
            state = (torch.exp(step * A[h]) * ssm_states[slot, h]
                     + step * torch.outer(x[i, h].float(), B[i, g].float()))
            ssm_states[slot, h] = state
            out[i, h] = state @ C[i, g].float() + D[h] * x[i, h].float()
    return out


def _tolerance(dtype: torch.dtype) -> float:
    """Of an output relative to its largest value (or 1)."""
    return 2e-2 if dtype == torch.bfloat16 else 1e-5   # bf16: an ulp or two


def test_reference_is_the_recurrence() -> None:
    for _, *shape, dtype, dt_limit in CASES:
        inputs = make_inputs(*shape, dtype)
        want_states = inputs[0].clone()
        want = _loop_reference(want_states, *inputs[1:], dt_limit)
        got = ref_selective_state_update(*inputs, dt_limit=dt_limit)
        assert got.dtype == dtype
        scale = want.abs().max().clamp(min=1)
        assert (got.float() - want).abs().max() <= _tolerance(dtype) * scale
        assert torch.allclose(inputs[0], want_states, atol=1e-5, rtol=1e-5)
        assert torch.equal(inputs[0][0], make_inputs(*shape, dtype)[0][0])   # slot 0 untouched


def test_triton_matches_reference() -> None:
    results = json_cases("tests.worker.test_mamba2_state_update")
    assert set(results) == {case[0] for case in CASES}
    for name, *_, dtype, _ in CASES:
        assert results[name]["out_err"] <= _tolerance(dtype), (name, results[name])
        assert results[name]["state_err"] <= 1e-5, (name, results[name])


def _views_of_one_projection(x: torch.Tensor, B: torch.Tensor,
                             C: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x, B and C on DEVICE as the mixer passes them: strided views of one [N, x | B | C]
    tensor (the conv's output)."""
    num_seqs = x.shape[0]
    packed = torch.cat([x.flatten(1), B.flatten(1), C.flatten(1)], dim=1).to(DEVICE)
    x_view, b_view, c_view = packed.split([x[0].numel(), B[0].numel(), C[0].numel()], dim=1)
    return (x_view.view(num_seqs, *x.shape[1:]), b_view.view(num_seqs, *B.shape[1:]),
            c_view.view(num_seqs, *C.shape[1:]))


def _compare_triton_with_reference() -> None:
    from kernels.triton_selective_state_update import selective_state_update

    for name, *shape, dtype, dt_limit in CASES:
        inputs = make_inputs(*shape, dtype)
        device_inputs = [t.to(DEVICE, copy=True) for t in inputs]   # the states: a copy
        device_inputs[2], device_inputs[6], device_inputs[7] = _views_of_one_projection(
            inputs[2], inputs[6], inputs[7])
        got = selective_state_update(*device_inputs, dt_limit=dt_limit).cpu()
        want = ref_selective_state_update(*inputs, dt_limit=dt_limit)
        state_err = (device_inputs[0].cpu() - inputs[0]).abs().max()
        out_err = (got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1)
        print(json.dumps({"case": name, "out_err": float(out_err),
                          "state_err": float(state_err)}), flush=True)


if __name__ == "__main__":
    _compare_triton_with_reference()
