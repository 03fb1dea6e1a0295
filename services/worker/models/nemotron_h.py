"""Nemotron-H (HF model_type "nemotron_h": Nemotron-H, Nemotron Nano 2): a hybrid whose layers
each hold one mixer, by the config's pattern (hybrid_override_pattern, or transformers 5's
layers_block_type): M a Mamba2 mixer, * causal attention, - an MLP of its own (ReLU², no gate).

Every layer is  h += mixer(rms_norm(h)).  The Mamba2 mixer is Bamba's (mamba2.py: one
in_proj to [gate | x B C | dt], conv with bias, gated RMSNorm over n_groups groups, dt after
softplus clamped to time_step_limit); the attention is on the paged KV without any rope (the
Mamba layers carry position) and without bias, as in vLLM and transformers. Checkpoints name
tensors under "backbone." (transformers 5 writes them back that way); the embeddings are
"embeddings", the final norm "norm_f". MoE layers (E: Nemotron 3 Nano) are not built.
The engine interface and the step's state slots are every hybrid's (hybrid_lm.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend
from services.worker.models.config import ModelConfig, UnsupportedModelError, nemotron_h_pattern
from services.worker.models.hybrid_attention import HybridAttention
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

MAMBA, ATTENTION, MLP, MOE = "M", "*", "-", "E"
# Nemotron-H's names for the Mamba2 sizes: field -> (config key, default).
MAMBA2_KEYS = {"state_size": ("ssm_state_size", 128), "num_groups": ("n_groups", 8),
               "conv_kernel": ("conv_kernel", 4), "chunk_size": ("chunk_size", 128)}


@dataclass(frozen=True)
class NemotronHConfig:
    """What the model reads of an HF Nemotron-H config.json."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int         # the MLP layers'
    pattern: str                   # a char per layer: MAMBA, ATTENTION or MLP
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_norm_epsilon: float
    mlp_bias: bool
    tie_word_embeddings: bool
    mamba: Mamba2Shape
    dt_limit: tuple[float, float]  # time_step_limit: dt after softplus is clamped to it

    @classmethod
    def from_dir(cls, model_dir: Path) -> NemotronHConfig:
        return cls.from_dict(read_config_json(model_dir))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> NemotronHConfig:
        pattern = nemotron_h_pattern(raw)
        if MOE in pattern:
            raise UnsupportedModelError(
                "Nemotron-H with MoE layers (E in its hybrid_override_pattern, as Nemotron 3 "
                "Nano) is not supported; its Mamba2, attention and MLP layers are")
        for key, built in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
            if raw.get(key, built) != built:
                raise UnsupportedModelError(f"Nemotron-H with {key} {raw[key]!r} is not "
                                            f"supported (only {built!r})")
        hidden, num_heads = raw["hidden_size"], raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"], hidden_size=hidden,
            intermediate_size=raw["intermediate_size"], pattern=pattern,
            num_attention_heads=num_heads,
            num_key_value_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or hidden // num_heads,
            layer_norm_epsilon=raw.get("layer_norm_epsilon", 1e-5),
            mlp_bias=raw.get("mlp_bias", False),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            mamba=read_mamba2_shape(raw, MAMBA2_KEYS, hidden_size=hidden,
                                    num_heads=raw["mamba_num_heads"],
                                    head_dim=raw["mamba_head_dim"]),
            # NOTE: vLLM and NVIDIA's reference clamp dt to time_step_limit ((0, inf) as
            # shipped); transformers 5 clamps prefills at time_step_min (decodes not at all).
            dt_limit=read_dt_limit(raw))


class ReluSquaredMLP:
    """Nemotron-H's MLP layer: down_proj(relu(up_proj(x))²), no gate."""

    def __init__(self, weights: WeightSource, prefix: str, has_bias: bool):
        self.up_proj = Linear(weights.get(prefix + "up_proj.weight"),
                              weights.get(prefix + "up_proj.bias") if has_bias else None)
        self.down_proj = Linear(weights.get(prefix + "down_proj.weight"),
                                weights.get(prefix + "down_proj.bias") if has_bias else None)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.relu(self.up_proj(hidden)).square())


class NemotronHDecoderLayer:
    """h += mixer(rms_norm(h)), the mixer by the layer's char in the pattern."""

    def __init__(self, config: NemotronHConfig, weights: WeightSource, index: int,
                 attn: AttentionBackend):
        prefix = f"layers.{index}.mixer."
        kind = config.pattern[index]
        self.mixer: Mamba2Mixer | HybridAttention | ReluSquaredMLP
        if kind == MAMBA:
            self.mixer = Mamba2Mixer(config.mamba, weights, prefix, config.layer_norm_epsilon,
                                     config.dt_limit)
        elif kind == ATTENTION:
            self.mixer = HybridAttention(weights, prefix, config.num_attention_heads,
                                         config.num_key_value_heads, config.head_dim,
                                         has_bias=False, rotary=None, attn=attn)
        elif kind == MLP:
            self.mixer = ReluSquaredMLP(weights, prefix, config.mlp_bias)
        else:
            raise UnsupportedModelError(f"Nemotron-H layer kind {kind!r} is not supported")
        self.norm = weights.get(f"layers.{index}.norm.weight")
        self.eps = config.layer_norm_epsilon

    def forward(self, hidden: torch.Tensor, step: HybridStep,
                state: Mamba2State | None) -> torch.Tensor:
        normed = rms_norm(hidden, self.norm, self.eps)
        if isinstance(self.mixer, ReluSquaredMLP):
            return hidden + self.mixer.forward(normed)
        return hidden + mix(self.mixer, normed, step, state)


class NemotronHForCausalLM(HybridForCausalLM):
    def __init__(self, config: ModelConfig, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, blocks: BlockSource | None = None,
                 quantization: str = "none"):
        """The registry's constructor (registry.py), shared with the Llama family; Nemotron-H
        reads its layer pattern and Mamba shapes from its own config.json."""
        check_unquantized(weights, blocks, quantization, "Nemotron-H")
        self.config = nemotron = NemotronHConfig.from_dir(weights.model_dir)
        weights = weights.renamed("", "backbone.")
        embed_tokens = weights.get("embeddings.weight")
        tied = nemotron.tie_word_embeddings or "lm_head.weight" not in weights
        super().__init__(
            weights, nemotron.mamba,
            [NemotronHDecoderLayer(nemotron, weights, i, attn)
             for i in range(len(nemotron.pattern))],
            None, embed_tokens, weights.get("norm_f.weight"), nemotron.layer_norm_epsilon,
            embed_tokens if tied else weights.get("lm_head.weight"))
