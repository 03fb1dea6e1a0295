"""Bamba (HF model_type "bamba"): a hybrid of Mamba2 and full-attention layers, each with an MLP.

Every layer is  h += mixer(rms_norm(h));  h += mlp(rms_norm(h)),  where the mixer is a Mamba2
mixer (mamba2.py), or causal attention at the config's attn_layer_indices (partial rope over
half of each head, hybrid_attention.py). The engine interface, the step's state slots and the
layer loop are every hybrid's (hybrid_lm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend
from services.worker.models.config import ModelConfig
from services.worker.models.hybrid_attention import HybridAttention, PartialRotary
from services.worker.models.hybrid_lm import (
    HybridForCausalLM,
    HybridStep,
    check_unquantized,
    mix,
    read_config_json,
    read_dt_limit,
    read_mamba2_shape,
    rms_norm,
)
from services.worker.models.layers import Linear
from services.worker.models.mamba2 import Mamba2Mixer, Mamba2Shape, Mamba2State
from services.worker.models.quantized import BlockSource
from services.worker.models.weights import WeightSource


# Bamba's names for the Mamba2 sizes: field -> (config key, default).
MAMBA2_KEYS = {"state_size": ("mamba_d_state", 256), "num_groups": ("mamba_n_groups", 1),
               "conv_kernel": ("mamba_d_conv", 4), "chunk_size": ("mamba_chunk_size", 256)}


@dataclass(frozen=True)
class BambaConfig:
    """What the model reads of an HF Bamba config.json."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    attn_layer_indices: tuple[int, ...]
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    mamba: Mamba2Shape
    dt_limit: tuple[float, float]       # time_step_limit: dt after softplus is clamped to it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dir(cls, model_dir: Path) -> BambaConfig:
        return cls.from_dict(read_config_json(model_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> BambaConfig:
        hidden, num_heads = raw["hidden_size"], raw["mamba_n_heads"]
        head_dim = raw.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = raw.get("mamba_expand", 2) * hidden // num_heads
        # NOTE: transformers 5 moved rope_theta into rope_parameters; older checkpoints keep it
        # at the top level. Bamba's rope covers half of each head either way.
        rope = raw.get("rope_parameters") or {}
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            partial_rotary_factor=rope.get("partial_rotary_factor", 0.5),
            attn_layer_indices=tuple(raw.get("attn_layer_indices") or ()),
            attention_bias=raw.get("attention_bias", False), mlp_bias=raw.get("mlp_bias", False),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            mamba=read_mamba2_shape(raw, MAMBA2_KEYS, hidden_size=hidden, num_heads=num_heads,
                                    head_dim=head_dim),
            dt_limit=read_dt_limit(raw))


class BambaDecoderLayer:
    """h += mixer(rms_norm(h));  h += mlp(rms_norm(h)): a gated SiLU MLP after every mixer."""

    def __init__(self, config: BambaConfig, weights: WeightSource, index: int,
                 rotary: PartialRotary, attn: AttentionBackend):
        prefix = f"layers.{index}."
        self.mixer: Mamba2Mixer | HybridAttention
        if index in config.attn_layer_indices:
            self.mixer = HybridAttention(weights, prefix + "self_attn.",
                                         config.num_attention_heads, config.num_key_value_heads,
                                         config.head_dim, config.attention_bias, rotary, attn)
        else:
            self.mixer = Mamba2Mixer(config.mamba, weights, prefix + "mamba.",
                                     config.rms_norm_eps, config.dt_limit)
        mlp = prefix + "feed_forward."
        gate_up_bias = (weights.get_fused([mlp + "gate_proj.bias", mlp + "up_proj.bias"])
                        if config.mlp_bias else None)
        self.gate_up_proj = Linear(
            weights.get_fused([mlp + "gate_proj.weight", mlp + "up_proj.weight"]), gate_up_bias)
        self.down_proj = Linear(weights.get(mlp + "down_proj.weight"),
                                weights.get(mlp + "down_proj.bias") if config.mlp_bias else None)
        self.input_layernorm = weights.get(prefix + "input_layernorm.weight")
        self.pre_ff_layernorm = weights.get(prefix + "pre_ff_layernorm.weight")
        self.eps = config.rms_norm_eps

    def forward(self, hidden: torch.Tensor, step: HybridStep,
                state: Mamba2State | None) -> torch.Tensor:
        hidden = hidden + mix(self.mixer, rms_norm(hidden, self.input_layernorm, self.eps),
                              step, state)
        gate, up = self.gate_up_proj(rms_norm(hidden, self.pre_ff_layernorm, self.eps)).chunk(
            2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class BambaForCausalLM(HybridForCausalLM):
    def __init__(self, config: ModelConfig, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, blocks: BlockSource | None = None,
                 quantization: str = "none"):
        """The registry's constructor (registry.py), shared with the Llama family; Bamba reads
        its Mamba shapes from its own config.json (BambaConfig), and its rope needs no table
        up to max_position."""
        check_unquantized(weights, blocks, quantization, "Bamba")
        self.config = bamba = BambaConfig.from_dir(weights.model_dir)
        rotary = PartialRotary(bamba.head_dim, bamba.partial_rotary_factor, bamba.rope_theta,
                               weights.device)
        embed_tokens = weights.get("embed_tokens.weight")
        tied = bamba.tie_word_embeddings or "lm_head.weight" not in weights
        super().__init__(
            weights, bamba.mamba,
            [BambaDecoderLayer(bamba, weights, i, rotary, attn)
             for i in range(bamba.num_hidden_layers)],
            rotary, embed_tokens, weights.get("final_layernorm.weight"), bamba.rms_norm_eps,
            embed_tokens if tied else weights.get("lm_head.weight"))
