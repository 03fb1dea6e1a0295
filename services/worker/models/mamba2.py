"""The Mamba2 mixer over a flattened varlen batch, its recurrent state held in per-sequence slots.

A Mamba2 layer keeps no KV: each sequence carries a fixed-size state, whatever its length, a
conv state (the last K-1 inputs of its causal conv) and an SSM state ([heads, head_dim,
state_size]). The states of all sequences live in two tensors indexed by a slot id
(Mamba2State); a step names each sequence's slot, how many of its tokens the state has seen and
its rows in the batch (StateBatch), so prefills of any lengths, continued prefill chunks and
decodes run in one call. vLLM keeps the same two tensors per layer as pages of its block pool
(MambaSpec); a slot here is meant to become such a page (docs/hybrid_models.md).

Per token: in_proj -> [gate | x B C | dt]; x B C through the causal conv + SiLU; the SSD scan
(mamba2_ops.py) over x with dt, A, B, C, D; RMSNorm of y * silu(gate) per group; out_proj.
Decodes (one token continuing a state) are batched: one conv update and one
selective_state_update for all of them (the Triton kernel on CUDA, its torch reference
elsewhere); prefills scan sequence by sequence. Sequences verifying drafts (speculative
decoding) take that decode step once per token, batched over them, keeping the state after
each token (Mamba2State.token_states), so the worker can roll a slot back to the accepted
tokens (runner/hybrid_states.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.mamba_reference import ref_selective_state_update
from services.worker.models.layers import Linear
from services.worker.models.mamba2_ops import (
    causal_conv1d,
    causal_conv1d_update,
    discretize_dt,
    gated_rms_norm,
    ssd_scan,
)
from services.worker.models.weights import WeightSource


@dataclass(frozen=True)
class Mamba2Shape:
    """A Mamba2 layer's sizes (HF's mamba_* config keys), and the state they imply."""
    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int          # d_state
    num_groups: int          # B and C are shared by num_heads / num_groups heads
    conv_kernel: int         # d_conv
    chunk_size: int          # the SSD scan's; the result does not depend on it

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels through the conv: x, B and C."""
        return self.intermediate_size + 2 * self.num_groups * self.state_size

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return self.conv_dim, self.conv_kernel - 1

    @property
    def ssm_state_shape(self) -> tuple[int, int, int]:
        return self.num_heads, self.head_dim, self.state_size

    def state_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
        """One sequence's state in one layer (vLLM's MambaSpec page before padding)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_dtype.itemsize
        ssm = self.num_heads * self.head_dim * self.state_size * ssm_dtype.itemsize
        return conv + ssm


@dataclass
class TokenStates:
    """The states of a pass's verifying sequences after each of their tokens: conv_states
    [N, L, conv_dim, K-1], ssm_states [N, L, heads, head_dim, state_size], sequence i in the
    order of StateBatch.verify_seqs, L the longest one's tokens (a shorter one's entries past
    its last token are unset)."""
    conv_states: torch.Tensor
    ssm_states: torch.Tensor


@dataclass
class Mamba2State:
    """One layer's states for num_slots sequences: conv_states [slots, conv_dim, K-1] and
    ssm_states [slots, heads, head_dim, state_size]."""
    conv_states: torch.Tensor
    ssm_states: torch.Tensor
    token_states: TokenStates | None = None
    """Set by a forward pass with verifying sequences: the worker reads it, then drops it."""

    @classmethod
    def allocate(cls, shape: Mamba2Shape, num_slots: int, dtype: torch.dtype,
                 ssm_dtype: torch.dtype, device: torch.device) -> Mamba2State:
        """ssm_dtype: fp32 keeps a long decode from drifting (vLLM's mamba_ssm_cache_dtype)."""
        return cls(torch.zeros(num_slots, *shape.conv_state_shape, dtype=dtype, device=device),
                   torch.zeros(num_slots, *shape.ssm_state_shape, dtype=ssm_dtype,
                               device=device))


@dataclass(frozen=True)
class StateBatch:
    """A flattened varlen batch: sequence i owns rows query_start_loc[i]:query_start_loc[i+1],
    continues the state in slot state_indices[i], which has seen num_computed_tokens[i] of its
    tokens (0: a new sequence, whose state starts at zero whatever its slot holds).
    verify_seqs: sequences whose query holds drafts to verify (they continue a state): their
    state after each token is kept, for the rollback past rejected drafts."""
    state_indices: tuple[int, ...]
    query_start_loc: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    verify_seqs: tuple[int, ...] = ()

    @classmethod
    def from_query_lens(cls, state_indices: list[int], query_lens: list[int],
                        num_computed_tokens: list[int]) -> StateBatch:
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        return cls(tuple(state_indices), tuple(starts), tuple(num_computed_tokens))

    @property
    def num_seqs(self) -> int:
        return len(self.state_indices)

    def rows(self, seq: int) -> slice:
        return slice(self.query_start_loc[seq], self.query_start_loc[seq + 1])

    @cached_property
    def decode_seqs(self) -> tuple[int, ...]:
        """Sequences with one token continuing a state: batched through the recurrent step."""
        return tuple(i for i in range(self.num_seqs)
                     if self.query_start_loc[i + 1] - self.query_start_loc[i] == 1
                     and self.num_computed_tokens[i] > 0)

    @cached_property
    def prefill_seqs(self) -> tuple[int, ...]:
        others = {*self.decode_seqs, *self.verify_seqs}
        return tuple(i for i in range(self.num_seqs) if i not in others)


class Mamba2Mixer:
    """A Mamba2 mixer's weights (under `prefix`: Bamba's `mamba.`, Nemotron-H's `mixer.`) and its
    forward pass."""

    def __init__(self, shape: Mamba2Shape, weights: WeightSource, prefix: str, eps: float,
                 dt_limit: tuple[float, float]):
        self.shape = shape
        self.in_proj = Linear(weights.get(prefix + "in_proj.weight"), self._bias(
            weights, prefix + "in_proj.bias"))
        self.out_proj = Linear(weights.get(prefix + "out_proj.weight"), self._bias(
            weights, prefix + "out_proj.bias"))
        self.conv_weight = weights.get(prefix + "conv1d.weight")[:, 0, :]   # [conv_dim, K]
        self.conv_bias = self._bias(weights, prefix + "conv1d.bias")
        # NOTE: the SSM parameters stay fp32 whatever the model dtype, as in HF and vLLM.
        self.A = -torch.exp(weights.get(prefix + "A_log", torch.float32))
        self.D = weights.get(prefix + "D", torch.float32)
        self.dt_bias = weights.get(prefix + "dt_bias", torch.float32)
        self.norm_weight = weights.get(prefix + "norm.weight")
        self.eps = eps
        self.dt_limit = dt_limit
        self.state_update = ref_selective_state_update
        if weights.device.type == "cuda":
            from kernels.triton_selective_state_update import selective_state_update
            self.state_update = selective_state_update   # NOTE: triton loads where a GPU runs it

    @staticmethod
    def _bias(weights: WeightSource, name: str) -> torch.Tensor | None:
        return weights.get(name) if name in weights else None

    def forward(self, hidden: torch.Tensor, batch: StateBatch,
                state: Mamba2State) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size]; each sequence's slot of `state`
        is left as it stands after the sequence's last token."""
        s = self.shape
        gate, xbc, dt = self.in_proj(hidden).split(
            [s.intermediate_size, s.conv_dim, s.num_heads], dim=-1)
        y = torch.empty(hidden.shape[0], s.num_heads, s.head_dim, dtype=torch.float32,
                        device=hidden.device)
        state.token_states = None
        if batch.decode_seqs:
            seqs = batch.decode_seqs
            self._decode(xbc, dt, [batch.query_start_loc[i] for i in seqs],
                         [batch.state_indices[i] for i in seqs], state, y)
        if batch.verify_seqs:
            self._verify(xbc, dt, batch, state, y)
        for seq in batch.prefill_seqs:
            self._prefill(xbc, dt, batch, seq, state, y)
        normed = gated_rms_norm(y.view(hidden.shape[0], -1), gate, self.norm_weight,
                                s.num_groups, self.eps, hidden.dtype)
        return self.out_proj(normed)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, H, P], B and C [n, G, S] out of the conv's output."""
        s = self.shape
        group_width = s.num_groups * s.state_size
        x, B, C = xbc.split([s.intermediate_size, group_width, group_width], dim=-1)
        n = xbc.shape[0]
        return (x.reshape(n, s.num_heads, s.head_dim), B.reshape(n, s.num_groups, s.state_size),
                C.reshape(n, s.num_groups, s.state_size))

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, token_rows: list[int],
                state_slots: list[int], state: Mamba2State, y: torch.Tensor) -> None:
        """One token per sequence (at `token_rows` of the batch) continuing its state in
        `state_slots` of `state`."""
        rows = torch.tensor(token_rows, device=xbc.device)
        slots = torch.tensor(state_slots, dtype=torch.int32,
                             device=xbc.device)   # the kernel's index type
        slot_rows = slots.long()
        conv_out, conv_states = causal_conv1d_update(
            xbc[rows], state.conv_states[slot_rows], self.conv_weight, self.conv_bias)
        state.conv_states[slot_rows] = conv_states.to(state.conv_states.dtype)
        x, B, C = self._split_xbc(conv_out)
        y[rows] = self.state_update(state.ssm_states, slots, x, dt[rows].contiguous(),
                                    self.dt_bias, self.A, B, C, self.D, self.dt_limit).float()

    def _verify(self, xbc: torch.Tensor, dt: torch.Tensor, batch: StateBatch,
                state: Mamba2State, y: torch.Tensor) -> None:
        """The verifying sequences' few tokens through the decode step one position at a
        time (the arithmetic of decoding them one by one), on copies of their states, keeping
        the copy after each position in `state.token_states`; their slots end as after their
        last token."""
        seqs = batch.verify_seqs
        slots = torch.tensor([batch.state_indices[i] for i in seqs], device=xbc.device)
        work = Mamba2State(state.conv_states[slots], state.ssm_states[slots])
        lens = [batch.query_start_loc[i + 1] - batch.query_start_loc[i] for i in seqs]
        kept = TokenStates(
            work.conv_states.new_empty(len(seqs), max(lens), *work.conv_states.shape[1:]),
            work.ssm_states.new_empty(len(seqs), max(lens), *work.ssm_states.shape[1:]))
        for position in range(max(lens)):
            active = [i for i, num_tokens in enumerate(lens) if num_tokens > position]
            self._decode(xbc, dt, [batch.query_start_loc[seqs[i]] + position for i in active],
                         active, work, y)
            kept.conv_states[:, position] = work.conv_states
            kept.ssm_states[:, position] = work.ssm_states
        state.conv_states[slots] = work.conv_states
        state.ssm_states[slots] = work.ssm_states
        state.token_states = kept

    def _prefill(self, xbc: torch.Tensor, dt: torch.Tensor, batch: StateBatch, seq: int,
                 state: Mamba2State, y: torch.Tensor) -> None:
        rows, slot = batch.rows(seq), batch.state_indices[seq]
        conv_state, ssm_state = state.conv_states[slot], state.ssm_states[slot]
        if batch.num_computed_tokens[seq] == 0:
            conv_state, ssm_state = torch.zeros_like(conv_state), torch.zeros_like(ssm_state)
        conv_out, conv_state = causal_conv1d(xbc[rows], conv_state, self.conv_weight,
                                             self.conv_bias)
        x, B, C = self._split_xbc(conv_out)
        y[rows], ssm_state = ssd_scan(x, discretize_dt(dt[rows], self.dt_bias, self.dt_limit),
                                      self.A, B, C, self.D, ssm_state, self.shape.chunk_size)
        state.conv_states[slot] = conv_state.to(state.conv_states.dtype)
        state.ssm_states[slot] = ssm_state.to(state.ssm_states.dtype)
