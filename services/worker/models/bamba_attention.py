"""A hybrid model's few attention layers, over per-slot KV tensors (not yet the paged engine path).

NOTE: a stand-in until hybrids join the engine's block pool (docs/hybrid_models.md): each slot
holds one sequence's keys and values contiguously, [num_slots, max_seq_len, kv_heads, head_dim],
indexed by the same slot id as its Mamba states, so a model runs prefill and decode over slots
with no block tables. Attention is computed sequence by sequence in fp32, as a reference.

Rope as Bamba's: rotate-half over the first partial_rotary_factor of each head's dims.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.models.layers import Linear
from services.worker.models.mamba2 import StateBatch
from services.worker.models.weights import WeightSource


@dataclass
class SlotKVCache:
    """One attention layer's keys and values, [num_slots, max_seq_len, kv_heads, head_dim]."""
    key_cache: torch.Tensor
    value_cache: torch.Tensor

    @classmethod
    def allocate(cls, num_slots: int, max_seq_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> SlotKVCache:
        shape = (num_slots, max_seq_len, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


class PartialRotary:
    """cos / sin for the first rotary_dim dims of a head (the rest pass through)."""

    def __init__(self, head_dim: int, partial_rotary_factor: float, theta: float,
                 device: torch.device):
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        self.inv_freq = (1.0 / theta ** exponents).to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] (fp32) at positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, head_dim] with its first rotary_dim dims rotated (rotate-half)."""
        rot, rest = x[..., :self.rotary_dim].float(), x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([rot.to(x.dtype), rest], dim=-1)


class SlotAttention:
    """Causal multi-head attention (grouped KV heads) of HF's `self_attn.` names under prefix."""

    def __init__(self, weights: WeightSource, prefix: str, num_heads: int, num_kv_heads: int,
                 head_dim: int, has_bias: bool, rotary: PartialRotary):
        names = [f"{prefix}{p}_proj" for p in ("q", "k", "v")]
        bias = weights.get_fused([n + ".bias" for n in names]) if has_bias else None
        self.qkv_proj = Linear(weights.get_fused([n + ".weight" for n in names]), bias)
        self.o_proj = Linear(weights.get(prefix + "o_proj.weight"),
                             weights.get(prefix + "o_proj.bias") if has_bias else None)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotary = rotary

    def forward(self, hidden: torch.Tensor, batch: StateBatch, cos: torch.Tensor,
                sin: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([self.num_heads * self.head_dim, kv_size, kv_size],
                                              dim=-1)
        q = self.rotary.apply(q.reshape(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = self.rotary.apply(k.reshape(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = torch.empty_like(q)
        for seq in range(batch.num_seqs):
            out[batch.rows(seq)] = self._attend(q, k, v, batch, seq, cache)
        return self.o_proj(out.view(num_tokens, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StateBatch,
                seq: int, cache: SlotKVCache) -> torch.Tensor:
        """One sequence's new tokens: their keys and values stored in its slot after the
        num_computed_tokens already there, then attended over all of them, causally."""
        rows, slot = batch.rows(seq), batch.state_indices[seq]
        start = batch.num_computed_tokens[seq]
        end = start + rows.stop - rows.start
        cache.key_cache[slot, start:end] = k[rows]
        cache.value_cache[slot, start:end] = v[rows]
        group = self.num_heads // self.num_kv_heads
        keys = cache.key_cache[slot, :end].float().repeat_interleave(group, dim=1)
        values = cache.value_cache[slot, :end].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), keys) * self.scale
        # Query i (at position start + i) sees keys 0 .. start + i.
        visible = torch.ones(end - start, end, dtype=torch.bool, device=q.device).tril(start)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        return torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
