"""Bamba (HF model_type "bamba"): a hybrid of Mamba2 and full-attention layers, each with an MLP.

Every layer is  h += mixer(rms_norm(h));  h += mlp(rms_norm(h)),  where the mixer is a Mamba2
mixer (mamba2.py), or causal attention at the config's attn_layer_indices (partial rope over
half of each head, bamba_attention.py). A step runs the engine's flattened varlen batch: the
attention layers read and write the paged KV cache through the attention backend, the Mamba
layers continue each sequence's state in its slot, which the step names beforehand
(set_step_states: the worker's slot of a request is its persistent row,
runner/hybrid_states.py), so prompts, continued prefill chunks and decodes share one pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, KVCache
from services.worker.models.bamba_attention import BambaAttention, PartialRotary
from services.worker.models.config import ModelConfig, UnsupportedModelError
from services.worker.models.layers import Linear
from services.worker.models.mamba2 import Mamba2Mixer, Mamba2Shape, Mamba2State, StateBatch
from services.worker.models.quantized import BlockSource
from services.worker.models.weights import WeightSource


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


def _num_bytes(*holders: object) -> int:
    """Bytes of the tensors and linears `holders` keep as attributes."""
    return sum(value.num_bytes if isinstance(value, Linear)
               else value.numel() * value.element_size()
               for holder in holders for value in vars(holder).values()
               if isinstance(value, Linear | torch.Tensor))


class BambaDecoderLayer:
    def __init__(self, config: BambaConfig, weights: WeightSource, index: int,
                 rotary: PartialRotary, attn: AttentionBackend):
        prefix = f"layers.{index}."
        self.mixer: Mamba2Mixer | BambaAttention
        if index in config.attn_layer_indices:
            self.mixer = BambaAttention(weights, prefix + "self_attn.",
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

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn_metadata: Any, states: StateBatch,
                state: Mamba2State | None) -> torch.Tensor:
        """`state`: this layer's slots where it is a Mamba layer."""
        normed = _rms_norm(hidden, self.input_layernorm, self.eps)
        if isinstance(self.mixer, BambaAttention):
            hidden = hidden + self.mixer.forward(normed, cos, sin, attn_metadata)
        else:
            assert state is not None
            hidden = hidden + self.mixer.forward(normed, states, state)
        gate, up = self.gate_up_proj(_rms_norm(hidden, self.pre_ff_layernorm, self.eps)).chunk(
            2, dim=-1)
        return hidden + self.down_proj(F.silu(gate) * up)


class BambaForCausalLM:
    """The engine's model interface (as LlamaForCausalLM's) over Bamba's layers."""

    def __init__(self, config: ModelConfig, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, blocks: BlockSource | None = None,
                 quantization: str = "none"):
        """The registry's constructor (registry.py), shared with the Llama family; Bamba reads
        its Mamba shapes from its own config.json (BambaConfig), and its rope needs no table
        up to max_position."""
        if quantization != "none" or blocks is not None or weights.quantization is not None:
            raise UnsupportedModelError("a hybrid (Bamba) model runs unquantized weights only")
        self.config = bamba = BambaConfig.from_dir(weights.model_dir)
        self.dtype, self.device = weights.dtype, weights.device
        self.rotary = PartialRotary(bamba.head_dim, bamba.partial_rotary_factor,
                                    bamba.rope_theta, weights.device)
        self.embed_tokens = weights.get("embed_tokens.weight")
        self.layers = [BambaDecoderLayer(bamba, weights, i, self.rotary, attn)
                       for i in range(bamba.num_hidden_layers)]
        self.mamba_layers = [layer for layer in self.layers
                             if isinstance(layer.mixer, Mamba2Mixer)]
        self.final_layernorm = weights.get("final_layernorm.weight")
        tied = bamba.tie_word_embeddings or "lm_head.weight" not in weights
        self.lm_head = Linear(self.embed_tokens if tied else weights.get("lm_head.weight"))
        self.num_bytes = _num_bytes(self, *self.layers, *(layer.mixer for layer in self.layers))
        self.small_batch_bytes = self.num_bytes   # no GGUF blocks: a step reads every weight
        self._step_states: tuple[list[Mamba2State], StateBatch] | None = None

    def allocate_states(self, num_slots: int,
                        ssm_dtype: torch.dtype = torch.float32) -> list[Mamba2State]:
        """Per Mamba layer, num_slots sequences' states."""
        return [Mamba2State.allocate(self.config.mamba, num_slots, self.dtype, ssm_dtype,
                                     self.device) for _ in self.mamba_layers]

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        attention = [layer.mixer for layer in self.layers
                     if isinstance(layer.mixer, BambaAttention)]
        for mixer, kv_cache in zip(attention, kv_caches, strict=True):
            mixer.kv_cache = kv_cache

    def set_step_states(self, states: list[Mamba2State], batch: StateBatch) -> None:
        """The Mamba layers' slots and the next forward pass's sequences in them."""
        assert len(states) == len(self.mamba_layers)
        self._step_states = states, batch

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of the flattened batch input_ids [T]."""
        assert inputs_embeds is None, "Bamba takes no input embeddings"
        assert self._step_states is not None, "set_step_states before each forward pass"
        states, batch = self._step_states
        self._step_states = None   # NOTE: one pass per StateBatch: a stale one is never reused
        slots = iter(states)
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.lookup(positions)
        for layer in self.layers:
            state = next(slots) if isinstance(layer.mixer, Mamba2Mixer) else None
            hidden = layer.forward(hidden, cos, sin, attn_metadata, batch, state)
        return _rms_norm(hidden, self.final_layernorm, self.config.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab]."""
        return self.lm_head(hidden).float()
