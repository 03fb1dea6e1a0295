"""A multi-token prediction (MTP) module shipped inside the target's checkpoint (vLLM's "mtp"
method), in MiMo's layout (vLLM's MiMoMTP; a Qwen2 / Llama-family target). MTP layer i is
stored under `model.mtp_layers.{i}.`:

- `token_layernorm` and `hidden_layernorm`: RMSNorms of the next token's embedding (the
  target's embed_tokens; zero at position 0, as vLLM masks it) and of the target's last
  hidden state, the residual stream leaving its last layer before the final norm (what
  vLLM's MiMoModel returns).
- `input_proj` [H, 2H] over concat(hidden_layernorm(h), token_layernorm(e)): hidden first,
  where DeepSeek's `eh_proj` reads the embedding first.
- One decoder layer of the target's kind (`self_attn.*`, `mlp.*`, `input_layernorm`,
  `post_attention_layernorm`) whose residual stream starts from input_proj's output, then
  `final_layernorm` and the target's lm_head.

Its normed output also stands in for the target's hidden state when the module drafts on
from its own draft: vLLM chains MTP so, and so k drafts run layer 0 k times whatever
num_nextn_predict_layers says (the other layers are not read).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from services.worker.attention.backend import AttentionBackend, KVCache
from services.worker.models.config import ModelConfig
from services.worker.models.layer_ops import layer_ops_for
from services.worker.models.layers import Linear
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from services.worker.models.registry import model_class
from services.worker.models.rotary import RotaryEmbedding
from services.worker.models.weights import WeightSource
from services.worker.runner.cpu_runtime import load_cpu_kernels

MTP_PREFIX = "mtp_layers.0."   # as WeightSource reads it: the checkpoint's "model." dropped
_MTP_NAMES = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
              "final_layernorm.weight")
_BLOCK_NAMES = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
                "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
                "post_attention_layernorm.weight")


class MTPError(ValueError):
    """A target checkpoint whose MTP layers cannot draft."""


def mtp_layer_config(target: ModelConfig) -> ModelConfig:
    """The MTP layer's shape: one global-attention layer of the target's."""
    return replace(target, num_hidden_layers=1, layer_sliding_windows=(None,))


class MTPHead:
    def __init__(self, target_dir: Path, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, target: ModelConfig,
                 target_model: Callable[[], LlamaForCausalLM]) -> None:
        """target_model: the model the runner serves now, whose embedding and lm_head the
        module shares."""
        check_mtp_checkpoint(target_dir, weights, target)
        self.config = config = mtp_layer_config(target)
        self.target_model = target_model
        # The stream leaving the target's last layer.
        self.aux_layer_ids = (target.num_hidden_layers,)
        kernels = load_cpu_kernels() if weights.device.type == "cpu" else None
        self.ops = layer_ops_for(weights.device, kernels)
        layer_weights = weights.renamed("layers.0.", MTP_PREFIX)

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            return Linear(layer_weights.get_fused(names), bias, None, kernels)

        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta,
                                 config.rope_scaling, weights.dtype, weights.device,
                                 self.ops.rotary_kernels)
        self.layer = LlamaDecoderLayer(config, layer_weights, 0, attn, rotary, self.ops, linear)
        self.token_layernorm = weights.get(MTP_PREFIX + "token_layernorm.weight")
        self.hidden_layernorm = weights.get(MTP_PREFIX + "hidden_layernorm.weight")
        self.input_proj = linear([MTP_PREFIX + "input_proj.weight"])
        self.final_layernorm = weights.get(MTP_PREFIX + "final_layernorm.weight")

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        (self.layer.kv_cache,) = kv_caches

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        return aux_hidden_states   # the last hidden state, as it is

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, normed) hidden states [T, H] of one pass: logits' input and the next
        pass's hidden input alike."""
        ops, eps = self.ops, self.config.rms_norm_eps
        embeds = self.target_model().embed_input_ids(input_ids)
        embeds = embeds.masked_fill((positions == 0)[:, None], 0)
        both = torch.cat((ops.rms_norm(hidden, self.hidden_layernorm, eps),
                          ops.rms_norm(embeds, self.token_layernorm, eps)), dim=-1)
        cos, sin = self.layer.rotary.lookup(positions)
        out, residual = self.layer.forward(self.input_proj(both), None, cos, sin, attn_metadata)
        normed = ops.add_rms_norm(out, residual, self.final_layernorm, eps)[0]
        return normed, normed

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.target_model().compute_logits(normed).argmax(dim=-1)


def check_mtp_checkpoint(target_dir: Path, weights: WeightSource, target: ModelConfig) -> None:
    """Raises MTPError naming what keeps the checkpoint's MTP layer 0 from drafting."""
    name = target_dir.name
    if model_class(target.model_type) is not LlamaForCausalLM or target.mrope_section:
        raise MTPError(f"{name!r}: MTP drafts for Llama-family (Llama, Qwen2, Qwen3, MiMo) "
                       f"targets only, not {target.model_type}")
    wanted = [MTP_PREFIX + n for n in _MTP_NAMES + _BLOCK_NAMES]
    if target.attention_bias:
        wanted += [f"{MTP_PREFIX}self_attn.{p}_proj.bias" for p in "qkv"]
    if target.qk_norm:
        wanted += [f"{MTP_PREFIX}self_attn.{p}_norm.weight" for p in "qk"]
    missing = ["model." + n for n in wanted if not weights.has_stored(n)]
    if missing:
        layers = json.loads((target_dir / "config.json").read_text()).get(
            "num_nextn_predict_layers", 0)
        raise MTPError(
            f"{name!r} has no usable MTP layer (config.json's num_nextn_predict_layers: "
            f"{layers}): missing {len(missing)} of MiMo's tensors, e.g. "
            f"{', '.join(missing[:4])}; --speculative-config's mtp drafts with the module "
            f"shipped in the target checkpoint (vLLM's MiMo layout)")
