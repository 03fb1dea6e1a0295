"""A hybrid model's few attention layers, on the engine's paged KV cache and attention backend.

Each attention layer of a hybrid holds one layer of the paged cache (the KV cache spec counts
only these layers), written and read by the same backend as the Llama family's, so the block
tables and slot mapping of a step serve them unchanged. Bamba rotates the first
partial_rotary_factor of each head's dims (rotate-half), applied here before the backend's call;
Nemotron-H's attention has no positional encoding at all (its Mamba layers carry position).
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.attention.backend import AttentionBackend, KVCache
from services.worker.models.layers import Linear
from services.worker.models.weights import WeightSource

Rope = tuple[torch.Tensor, torch.Tensor]   # cos, sin [T, rotary_dim] of a step's positions


class PartialRotary:
    """cos / sin for the first rotary_dim dims of a head (the rest pass through)."""

    def __init__(self, head_dim: int, partial_rotary_factor: float, theta: float,
                 device: torch.device):
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim
        self.inv_freq = (1.0 / theta ** exponents).to(device)

    def lookup(self, positions: torch.Tensor) -> Rope:
        """cos, sin [T, rotary_dim] (fp32) at positions [T]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos(), angles.sin()

    def apply(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """x [T, heads, head_dim] with its first rotary_dim dims rotated (rotate-half)."""
        cos, sin = rope
        rot, rest = x[..., :self.rotary_dim].float(), x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        rot = rot * cos[:, None, :] + rotated * sin[:, None, :]
        return torch.cat([rot.to(x.dtype), rest], dim=-1)


class HybridAttention:
    """Causal multi-head attention (grouped KV heads) of HF's q/k/v/o_proj names under prefix;
    rotary None: no rope."""

    def __init__(self, weights: WeightSource, prefix: str, num_heads: int, num_kv_heads: int,
                 head_dim: int, has_bias: bool, rotary: PartialRotary | None,
                 attn: AttentionBackend):
        names = [f"{prefix}{p}_proj" for p in ("q", "k", "v")]
        bias = weights.get_fused([n + ".bias" for n in names]) if has_bias else None
        self.qkv_proj = Linear(weights.get_fused([n + ".weight" for n in names]), bias)
        self.o_proj = Linear(weights.get(prefix + "o_proj.weight"),
                             weights.get(prefix + "o_proj.bias") if has_bias else None)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rotary = rotary
        self.attn = attn
        self.kv_cache: KVCache | None = None

    def forward(self, hidden: torch.Tensor, rope: Rope | None,
                attn_metadata: Any) -> torch.Tensor:
        assert self.kv_cache is not None, "bind_kv_caches before the first step"
        num_tokens = hidden.shape[0]
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([self.num_heads * self.head_dim, kv_size, kv_size],
                                              dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.rotary is not None:
            assert rope is not None
            q, k = self.rotary.apply(q, rope), self.rotary.apply(k, rope)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn.forward(q.contiguous(), k.contiguous(), v.contiguous(),
                                             self.kv_cache, attn_metadata))
