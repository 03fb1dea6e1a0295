"""Bamba (HF model_type "bamba"): a hybrid of Mamba2 and full-attention layers, each with an MLP.

Every layer is  h += mixer(rms_norm(h));  h += mlp(rms_norm(h)),  where the mixer is a Mamba2
mixer (mamba2.py), or causal attention at the config's attn_layer_indices (partial rope over
half of each head). Runs a flattened varlen batch over per-sequence slots (StateBatch): a slot
holds a sequence's Mamba states in every Mamba layer and its keys and values in every attention
layer, so several prompts, continued prefill chunks and decodes share one forward pass.

NOTE: standalone for now: the engine's model runner, block pool and paged attention do not run
it yet (docs/hybrid_models.md says what is built and what is planned).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.models.bamba_attention import PartialRotary, SlotAttention, SlotKVCache
from services.worker.models.layers import Linear
from services.worker.models.mamba2 import Mamba2Mixer, Mamba2Shape, Mamba2State, StateBatch
from services.worker.models.weights import WeightSource

LayerState = Mamba2State | SlotKVCache


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
    def from_dict(cls, raw: dict[str, Any]) -> BambaConfig:
        hidden, num_heads = raw["hidden_size"], raw["mamba_n_heads"]
        head_dim = raw.get("mamba_d_head", "auto")
        if head_dim == "auto":
            head_dim = raw.get("mamba_expand", 2) * hidden // num_heads
        # NOTE: transformers 5 moved rope_theta into rope_parameters; older checkpoints keep it
        # at the top level. Bamba's rope covers half of each head either way.
        rope = raw.get("rope_parameters") or {}
        limit = raw.get("time_step_limit") or (0.0, float("inf"))
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
            mamba=Mamba2Shape(hidden_size=hidden, num_heads=num_heads, head_dim=head_dim,
                              state_size=raw.get("mamba_d_state", 256),
                              num_groups=raw.get("mamba_n_groups", 1),
                              conv_kernel=raw.get("mamba_d_conv", 4),
                              chunk_size=raw.get("mamba_chunk_size", 256)),
            dt_limit=(_json_float(limit[0]), _json_float(limit[1])))

    @classmethod
    def from_dir(cls, model_dir: Path) -> BambaConfig:
        return cls.from_dict(json.loads((model_dir / "config.json").read_text()))


def _json_float(value: float | dict[str, str]) -> float:
    """A float as transformers writes it to JSON: infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class BambaDecoderLayer:
    def __init__(self, config: BambaConfig, weights: WeightSource, index: int,
                 rotary: PartialRotary):
        prefix = f"layers.{index}."
        self.is_attention = index in config.attn_layer_indices
        self.mixer: Mamba2Mixer | SlotAttention
        if self.is_attention:
            self.mixer = SlotAttention(weights, prefix + "self_attn.",
                                       config.num_attention_heads, config.num_key_value_heads,
                                       config.head_dim, config.attention_bias, rotary)
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

    def forward(self, hidden: torch.Tensor, batch: StateBatch, cos: torch.Tensor,
                sin: torch.Tensor, state: LayerState) -> torch.Tensor:
        normed = _rms_norm(hidden, self.input_layernorm, self.eps)
        if isinstance(self.mixer, SlotAttention):
            hidden = hidden + self.mixer.forward(normed, batch, cos, sin, state)
        else:
            hidden = hidden + self.mixer.forward(normed, batch, state)
        gate, up = self.gate_up_proj(_rms_norm(hidden, self.pre_ff_layernorm, self.eps)).chunk(
            2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class BambaForCausalLM:
    def __init__(self, config: BambaConfig, weights: WeightSource):
        self.config = config
        self.dtype, self.device = weights.dtype, weights.device
        self.rotary = PartialRotary(config.head_dim, config.partial_rotary_factor,
                                    config.rope_theta, weights.device)
        self.embed_tokens = weights.get("embed_tokens.weight")
        self.layers = [BambaDecoderLayer(config, weights, i, self.rotary)
                       for i in range(config.num_hidden_layers)]
        self.final_layernorm = weights.get("final_layernorm.weight")
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed_tokens if tied else weights.get("lm_head.weight"))
        self.states: list[LayerState] = []

    @classmethod
    def from_pretrained(cls, model_dir: Path, dtype: torch.dtype,
                        device: torch.device) -> BambaForCausalLM:
        return cls(BambaConfig.from_dir(model_dir), WeightSource(model_dir, dtype, device))

    def allocate_states(self, num_slots: int, max_seq_len: int,
                        ssm_dtype: torch.dtype = torch.float32) -> list[LayerState]:
        """Per layer, num_slots sequences' Mamba states or (up to max_seq_len) keys and
        values."""
        config = self.config
        return [SlotKVCache.allocate(num_slots, max_seq_len, config.num_key_value_heads,
                                     config.head_dim, self.dtype, self.device)
                if layer.is_attention else
                Mamba2State.allocate(config.mamba, num_slots, self.dtype, ssm_dtype, self.device)
                for layer in self.layers]

    def bind_states(self, states: list[LayerState]) -> None:
        assert len(states) == len(self.layers)
        self.states = states

    def forward(self, input_ids: torch.Tensor, batch: StateBatch) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of the flattened batch input_ids [T]."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.lookup(batch.positions(self.device))
        for layer, state in zip(self.layers, self.states, strict=True):
            hidden = layer.forward(hidden, batch, cos, sin, state)
        return _rms_norm(hidden, self.final_layernorm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab]."""
        return self.lm_head(hidden).float()
