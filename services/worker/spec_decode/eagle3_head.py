"""An EAGLE-3 head (vLLM's "eagle3" method): one decoder layer that drafts from the target's
hidden states, in the checkpoint layout vLLM and SpecForge read (LlamaForCausalLMEagle3).

- `fc` [hidden, 3 * target hidden] projects the target's residual stream entering three of
  its layers (low, middle, high: config.json's eagle_config.eagle_aux_hidden_state_layer_ids,
  else vLLM's default 2, L // 2, L - 3) to one hidden state.
- The layer's attention reads concat(input_layernorm(embed(token)), hidden_norm(hidden))
  (2 * hidden wide), its residual stream starts from `hidden`; then the usual MLP, `norm`,
  and `lm_head` over a draft vocabulary of draft_vocab_size tokens, draft id i standing for
  target id i + d2t[i] (`t2d`, the inverse mask, is not needed to draft).
- A pass returns the normed state (for logits) and the pre-norm one, which stands in for
  the target's hidden state when the head drafts on from its own draft.
- Token embeddings are the target's unless the checkpoint has its own embed_tokens.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from services.worker.attention.backend import AttentionBackend, KVCache
from services.worker.models.config import ModelConfig
from services.worker.models.layer_ops import TorchLayerOps, layer_ops_for
from services.worker.models.layers import Linear
from services.worker.models.llama import LinearFactory, LlamaDecoderLayer
from services.worker.models.rotary import RotaryEmbedding
from services.worker.models.weights import WeightSource
from services.worker.runner.cpu_runtime import load_cpu_kernels

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")   # vLLM reads both


class Eagle3Error(ValueError):
    """An EAGLE-3 head that cannot draft for this target."""


class Eagle3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, weights: WeightSource, attn: AttentionBackend,
                 rotary: RotaryEmbedding, ops: TorchLayerOps, linear: LinearFactory) -> None:
        super().__init__(config, weights, 0, attn, rotary, ops, linear)
        self.hidden_norm = self._norm_weight(weights, "layers.0.hidden_norm.weight")

    def draft_forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream) for token embeddings and hidden states [T, H]."""
        ops, eps = self.ops, self.eps
        both = torch.cat((ops.rms_norm(embeds, self.input_layernorm, eps),
                          ops.rms_norm(hidden, self.hidden_norm, eps)), dim=-1)
        attn = self._attention(both, cos, sin, attn_metadata)
        # NOTE: add_rms_norm sums into attn's storage: `hidden` (a caller's) stays intact.
        normed, residual = ops.add_rms_norm(attn, hidden, self.post_attention_layernorm, eps)
        return self._mlp(normed), residual


class Eagle3Head:
    def __init__(self, head_dir: Path, weights: WeightSource, attn: AttentionBackend,
                 max_position: int, target: ModelConfig,
                 target_embedding: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.config = config = ModelConfig.from_hf_dir(head_dir)
        self.aux_layer_ids = read_aux_layer_ids(head_dir, config, target)
        kernels = load_cpu_kernels() if weights.device.type == "cpu" else None
        self.ops = layer_ops_for(weights.device, kernels)

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear:
            return Linear(weights.get_fused(names), bias, None, kernels)

        rotary = RotaryEmbedding(config.head_dim, max_position, config.rope_theta,
                                 config.rope_scaling, weights.dtype, weights.device,
                                 self.ops.rotary_kernels)
        self.layer = Eagle3DecoderLayer(config, weights, attn, rotary, self.ops, linear)
        self.fc = linear(["fc.weight"])
        self.norm = weights.get("norm.weight")
        self.lm_head = linear(["lm_head.weight"])
        draft_ids = torch.arange(self.lm_head.out_features, device=weights.device)
        self.draft_to_target = (draft_ids + weights.get_stored("d2t").long()
                                if weights.has_stored("d2t") else draft_ids)
        self.embedding = (functools.partial(F.embedding, weight=weights.get("embed_tokens.weight"))
                          if weights.has_stored("embed_tokens.weight") else target_embedding)

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        (self.layer.kv_cache,) = kv_caches

    def combine_hidden_states(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [T, 3 * target hidden] as the head's input [T, H]."""
        return self.fc(aux_hidden_states)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, pre-norm) hidden states [T, H] of one pass."""
        cos, sin = self.layer.rotary.lookup(positions)
        out, residual = self.layer.draft_forward(self.embedding(input_ids), hidden, cos, sin,
                                                 attn_metadata)
        return self.ops.add_rms_norm(out, residual, self.norm, self.config.rms_norm_eps)

    def greedy_tokens(self, normed: torch.Tensor) -> torch.Tensor:
        """The target ids of the draft vocabulary's argmax per row."""
        return self.draft_to_target[self.lm_head(normed).argmax(dim=-1)]


def read_aux_layer_ids(head_dir: Path, config: ModelConfig,
                       target: ModelConfig) -> tuple[int, int, int]:
    """The target layers whose input the head reads, after checking the head fits the
    target (Eagle3Error says why not)."""
    hf = json.loads((head_dir / "config.json").read_text())
    name = head_dir.name
    if not set(hf.get("architectures") or ()) & set(ARCHITECTURES):
        raise Eagle3Error(f"{name!r} is not an EAGLE-3 head: config.json's architectures "
                          f"should name {ARCHITECTURES[0]}")
    eagle = hf.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True) or config.num_hidden_layers != 1:
        raise Eagle3Error(f"{name!r}: only one-layer heads drafting from aux hidden states "
                          f"are supported")
    if hf.get("norm_before_residual"):
        raise Eagle3Error(f"{name!r}: norm_before_residual heads are not supported")
    target_hidden = hf.get("target_hidden_size", config.hidden_size)
    if target_hidden != target.hidden_size or config.hidden_size != target.hidden_size:
        raise Eagle3Error(f"{name!r} reads hidden states of {target_hidden} and embeds "
                          f"{config.hidden_size} wide, the target's are {target.hidden_size}")
    if config.vocab_size != target.vocab_size:
        raise Eagle3Error(f"{name!r} has a vocabulary of {config.vocab_size} tokens, the "
                          f"target {target.vocab_size}")
    num_layers = target.num_hidden_layers
    ids = tuple(eagle.get("eagle_aux_hidden_state_layer_ids")
                or (2, num_layers // 2, num_layers - 3))
    # NOTE: the target keeps them in layer order, as vLLM's does.
    if len(ids) != 3 or list(ids) != sorted(set(ids)) or not 0 <= ids[0] <= ids[-1] < num_layers:
        raise Eagle3Error(f"{name!r}: aux hidden state layers {list(ids)} are not three of "
                          f"the target's {num_layers} layers, in increasing order")
    return ids   # type: ignore[return-value]
