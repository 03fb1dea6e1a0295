"""Rotary position embeddings (neox / HF "rotate_half" style) with the scalings configs use."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from services.worker.models.config import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding:
    """cos / sin tables for every position, looked up once per step and shared by all layers.

    NOTE: the sign of rotate_half is folded into the sin table (its first half is negated), so
    applying rope is x * cos + roll(x, head_dim / 2) * sin: no slicing and no cat per layer.
    With the CPU kernels (`ops`), one C++ call rotates x in place with the same roundings.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, device: torch.device,
                 ops: ModuleType | None = None):
        inv_freq = _inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        # NOTE: the same fp32 arithmetic as HF (positions x inv_freq, then cos/sin, then the cast
        # to the model dtype), so fp32 logits match transformers bit for bit where it matters.
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        self.cos_cache = emb.cos().to(dtype).to(device)
        self.sin_cache = (emb.sin().to(dtype) * sign.to(dtype)).to(device)
        self.half = half
        self.ops = ops

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] for the step's positions."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [num_tokens, num_heads, head_dim]: in place with the CPU kernels (x may be
        a strided view), else into a new contiguous tensor. Returns the rotated tensor."""
        if self.ops is not None:
            self.ops.rotary_embedding(x, cos, sin)
            return x
        rotated = torch.roll(x, self.half, dims=-1).mul_(sin)
        # NOTE: a separate mul and add (not addcmul) round like HF's q * cos + rot(q) * sin.
        return (x * cos).add_(rotated)


def _inverse_frequencies(head_dim: int, theta: float,
                         scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise UnsupportedModelError(
        f"rope scaling {rope_type!r} is not supported (supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)})")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
