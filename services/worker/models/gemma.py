"""Gemma 2 and Gemma 3 (text-only, Gemma3ForCausalLM): the Llama layer with Gemma's changes.

- RMSNorm scales by (1 + weight): the checkpoint stores weight - 1, so the loaded scales get
  the one added back (in fp32, as HF computes it) and every norm runs as the Llama one.
- Four norms per layer: the attention's and the MLP's outputs are normalized too before they
  join the residual stream ("sandwich" norms).
- The embedding is scaled by sqrt(hidden_size) (rounded to the model dtype, as HF does).
- GELU(tanh)-and-mul MLP; attention scale query_pre_attn_scalar ** -0.5.
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap)); sliding and
  global layers alternate. Gemma 3: no caps, q/k RMSNorm per head, 5 sliding layers per global
  one, sliding layers with their own rope base (both from ModelConfig, handled in llama.py).
"""

from __future__ import annotations

from typing import Any

import torch

from services.worker.models.config import ModelConfig
from services.worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from services.worker.models.weights import WeightSource


def gemma_norm_weight(weights: WeightSource, name: str) -> torch.Tensor:
    """1 + the stored weight, added in fp32 and cast once to the model dtype."""
    return (1.0 + weights.get(name, torch.float32)).to(weights.dtype)


class GemmaDecoderLayer(LlamaDecoderLayer):
    _norm_weight = staticmethod(gemma_norm_weight)

    def __init__(self, config: ModelConfig, weights: WeightSource, index: int,
                 *args: Any) -> None:
        super().__init__(config, weights, index, *args)
        prefix = f"layers.{index}."
        self.pre_feedforward_layernorm = gemma_norm_weight(
            weights, prefix + "pre_feedforward_layernorm.weight")
        self.post_feedforward_layernorm = gemma_norm_weight(
            weights, prefix + "post_feedforward_layernorm.weight")

    @property
    def num_bytes(self) -> int:
        extra = (self.pre_feedforward_layernorm, self.post_feedforward_layernorm)
        return super().num_bytes + sum(t.numel() * t.element_size() for t in extra)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, attn_metadata: Any) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.ops.add_rms_norm(hidden, residual, self.input_layernorm,
                                                 self.eps)
        hidden = self.ops.rms_norm(self._attention(hidden, cos, sin, attn_metadata),
                                   self.post_attention_layernorm, self.eps)
        hidden, residual = self.ops.add_rms_norm(hidden, residual,
                                                 self.pre_feedforward_layernorm, self.eps)
        return self.ops.rms_norm(self._mlp(hidden), self.post_feedforward_layernorm,
                                 self.eps), residual


class GemmaForCausalLM(LlamaForCausalLM):
    layer_cls = GemmaDecoderLayer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.embed_scale = torch.tensor(self.config.hidden_size ** 0.5,
                                        dtype=self.embed_tokens.dtype)
        self.final_logit_softcapping = self.config.final_logit_softcapping

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed_input_ids(input_ids) * self.embed_scale

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
