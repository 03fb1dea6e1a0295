"""The Mamba2 mixer's torch pieces (services/worker/models/mamba2_ops.py) against their
definitions: the chunked SSD scan against the recurrence token by token, for any chunk size and
from a given state; the causal conv run in pieces against one run; a decode step of each against
the prefill form."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.worker.models.mamba2_ops import (
    causal_conv1d,
    causal_conv1d_update,
    discretize_dt,
    ssd_scan,
)

HEADS, GROUPS, HEAD_DIM, STATE_SIZE = 4, 2, 8, 6


def _scan_inputs(length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """x, dt (discretized), A, B, C, D and a nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    dt = discretize_dt(torch.randn(length, HEADS, generator=gen), torch.randn(HEADS, generator=gen),
                       (0.0, float("inf")))
    A = -torch.rand(HEADS, generator=gen) * 3
    B = torch.randn(length, GROUPS, STATE_SIZE, generator=gen)
    C = torch.randn(length, GROUPS, STATE_SIZE, generator=gen)
    D = torch.randn(HEADS, generator=gen)
    state = torch.randn(HEADS, HEAD_DIM, STATE_SIZE, generator=gen)
    return x, dt, A, B, C, D, state


def _recurrence(x, dt, A, B, C, D, state) -> tuple[torch.Tensor, torch.Tensor]:
    """state_t = exp(dt_t A) state_{t-1} + dt_t x_t ⊗ B_t;  y_t = state_t · C_t + D x_t."""
    B, C = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (B, C))
    ys = []
    for t in range(x.shape[0]):
        state = (torch.exp(dt[t] * A)[:, None, None] * state
                 + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :])
        ys.append(torch.einsum("hps,hs->hp", state, C[t]) + D[:, None] * x[t])
    return torch.stack(ys), state


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
def test_ssd_scan_is_the_recurrence(chunk_size: int) -> None:
    inputs = _scan_inputs(19)
    want_y, want_state = _recurrence(*inputs)
    y, state = ssd_scan(*inputs, chunk_size=chunk_size)
    assert torch.allclose(y, want_y, atol=1e-4, rtol=1e-4)
    assert torch.allclose(state, want_state, atol=1e-4, rtol=1e-4)


def test_ssd_scan_keeps_fp32_precision_over_a_long_chunk() -> None:
    # 256 tokens of strong decay: the log-decay's prefix sums reach ~-6e3 in one chunk.
    x, dt, A, B, C, D, state = _scan_inputs(256, seed=1)
    A = A * 4
    want_y, want_state = _recurrence(x, dt, A, B, C, D, state)
    y, final = ssd_scan(x, dt, A, B, C, D, state, chunk_size=256)
    assert torch.allclose(y, want_y, atol=1e-4, rtol=1e-4)
    assert torch.allclose(final, want_state, atol=1e-4, rtol=1e-4)


def test_causal_conv_in_pieces_equals_one_run() -> None:
    gen = torch.Generator().manual_seed(2)
    channels, width = 5, 4
    x = torch.randn(11, channels, generator=gen)
    weight, bias = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    # The definition: left-padded with zeros, then a depthwise conv and SiLU.
    want = F.silu(F.conv1d(F.pad(x.T, (width - 1, 0))[None], weight[:, None, :], bias,
                           groups=channels)[0]).T
    state = torch.zeros(channels, width - 1)
    pieces = []
    for rows in (slice(0, 6), slice(6, 7), slice(7, 9)):   # pieces shorter than the state too
        out, state = causal_conv1d(x[rows], state, weight, bias)
        pieces.append(out)
    for t in range(9, 11):                                  # then decode steps, batched as one
        out, states = causal_conv1d_update(x[t:t + 1], state[None], weight, bias)
        pieces.append(out)
        state = states[0]
    assert torch.allclose(torch.cat(pieces), want, atol=1e-6)
    assert torch.equal(state, x[-(width - 1):].T)
