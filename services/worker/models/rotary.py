"""Rotary position embeddings (neox / HF "rotate_half" style) with the scalings configs use."""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch

from services.worker.models.config import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn", "dynamic")


class RotaryEmbedding:
    """cos / sin tables for every position, looked up once per step and shared by all layers.

    NOTE: the sign of rotate_half is folded into the sin table (its first half is negated), so
    applying rope is x * cos + roll(x, head_dim / 2) * sin: no slicing and no cat per layer.
    With fused kernels (`ops`: the CPU kernels or kernels/triton_layer_ops), one call rotates x
    in place with the same roundings.
    """

    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, dtype: torch.dtype, device: torch.device,
                 ops: ModuleType | None = None):
        # NOTE: the same fp32 arithmetic as HF (positions x inv_freq, then cos/sin, then the
        # cast to the model dtype), so fp32 logits match transformers bit for bit where it
        # matters.
        freqs, attention_factor = _frequencies(head_dim, max_position, theta, scaling)
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sign = torch.cat((-torch.ones(half), torch.ones(half)))
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.cos_cache = cos.to(dtype).to(device)
        self.sin_cache = (sin.to(dtype) * sign.to(dtype)).to(device)
        self.half = half
        self.ops = ops

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] for the step's positions."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [num_tokens, num_heads, head_dim]: in place with the fused kernels (x may
        be a strided view), else into a new contiguous tensor. Returns the rotated tensor."""
        if self.ops is not None:
            self.ops.rotary_embedding(x, cos, sin)
            return x
        rotated = torch.roll(x, self.half, dims=-1).mul_(sin)
        # NOTE: a separate mul and add (not addcmul) round like HF's q * cos + rot(q) * sin.
        return (x * cos).add_(rotated)


def _frequencies(head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Rotation angles [max_position, head_dim / 2] (position x inverse frequency) and the
    factor cos / sin are scaled by."""
    positions = torch.arange(max_position, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "longrope":
        return _longrope_frequencies(exponents, theta, scaling, positions)
    if rope_type == "dynamic":
        return positions[:, None] * _dynamic_ntk_frequencies(exponents, theta, scaling,
                                                             max_position), 1.0
    if rope_type == "yarn":
        inv_freq, attention_factor = _yarn_frequencies(head_dim, exponents, theta, scaling)
        return positions[:, None] * inv_freq[None, :], attention_factor
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    elif rope_type != "default":
        raise UnsupportedModelError(
            f"rope scaling {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})")
    return positions[:, None] * inv_freq[None, :], 1.0


def _dynamic_ntk_frequencies(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                             max_position: int) -> torch.Tensor:
    """Dynamic NTK: past the pretraining context (max_position_embeddings), the rope base
    grows with the sequence length. Inverse frequencies [max_position, head_dim / 2].

    NOTE: per position, with the length the sequence had when that token was computed
    (p + 1): what HF's generate does one decode at a time (cached keys keep their rotation).
    HF rotates a whole prompt past the context with its full length instead.
    """
    factor = float(scaling["factor"])
    original = int(scaling["max_position_embeddings"])
    seq_lens = torch.clamp(torch.arange(1, max_position + 1), min=original)
    dim = 2 * exponents.numel()
    base = theta * ((factor * seq_lens / original) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponents[None, :])


def _yarn_frequencies(head_dim: int, exponents: torch.Tensor, theta: float,
                      scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN: high-frequency dimensions kept, low ones interpolated by `factor`, a linear ramp
    between (by rotations over the original context), and cos / sin scaled by mscale."""
    factor = float(scaling["factor"])
    original = int(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor, 1.0))

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low = correction_dim(scaling.get("beta_fast") or 32)
    high = correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low),
                       0, 1)
    pos_freqs = theta ** exponents
    extrapolation = 1 - ramp
    inv_freq = ((1.0 / (factor * pos_freqs)) * (1 - extrapolation)
                + (1.0 / pos_freqs) * extrapolation)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_frequencies(exponents: torch.Tensor, theta: float, scaling: dict[str, Any],
                          positions: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE ("su"): per-dimension factors, short ones for positions inside the
    pretraining context and long ones past it, and cos / sin scaled by an attention factor.

    NOTE: chosen per position: a token's keys are rotated once, when it is computed, and kept.
    HF rotates a whole sequence longer than the original context with the long factors (its
    generate even recomputes the cache at the crossing); vLLM picks one set per batch. Inside
    the original context all three agree.
    """
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling["factor"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    base = theta ** exponents
    short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base)
    long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base)
    inv_freq = torch.where(positions[:, None] < original, short[None, :], long[None, :])
    return positions[:, None] * inv_freq, float(attention_factor)


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
