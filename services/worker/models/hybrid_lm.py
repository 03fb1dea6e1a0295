"""What every hybrid (Mamba2 + attention) model shares: the engine's model interface over a stack
of layers, some Mamba2 mixers continuing per-sequence states in slots, some attention on the
paged KV cache (docs/hybrid_models.md).

A family (bamba.py, nemotron_h.py) reads its config and builds its layers; this class embeds,
runs the layers in order, and takes the step's state slots: the worker names them before each
forward pass (set_step_states: a request's slot is its persistent row, runner/hybrid_states.py),
so prompts, continued prefill chunks and decodes share one pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from services.worker.attention.backend import KVCache
from services.worker.models.config import UnsupportedModelError
from services.worker.models.hybrid_attention import HybridAttention, PartialRotary, Rope
from services.worker.models.layers import Linear
from services.worker.models.mamba2 import Mamba2Mixer, Mamba2Shape, Mamba2State, StateBatch
from services.worker.models.quantized import BlockSource
from services.worker.models.weights import WeightSource


@dataclass(frozen=True)
class HybridStep:
    """What a layer's mixer reads of a forward pass besides its input."""
    rope: Rope | None              # None: the model's attention takes no rope
    attn_metadata: Any
    batch: StateBatch


class HybridLayer(Protocol):
    mixer: object

    def forward(self, hidden: torch.Tensor, step: HybridStep,
                state: Mamba2State | None) -> torch.Tensor:
        """`state`: this layer's slots where its mixer is a Mamba2Mixer."""
        ...


def mix(mixer: Mamba2Mixer | HybridAttention, normed: torch.Tensor, step: HybridStep,
        state: Mamba2State | None) -> torch.Tensor:
    """A sequence mixer's output: attention on the paged KV, or Mamba2 on the step's slots."""
    if isinstance(mixer, HybridAttention):
        return mixer.forward(normed, step.rope, step.attn_metadata)
    assert state is not None
    return mixer.forward(normed, step.batch, state)


def check_unquantized(weights: WeightSource, blocks: BlockSource | None,
                      quantization: str, family: str) -> None:
    if quantization != "none" or blocks is not None or weights.quantization is not None:
        raise UnsupportedModelError(f"a hybrid ({family}) model runs unquantized weights only")


def read_config_json(model_dir: Path) -> dict[str, Any]:
    return json.loads((model_dir / "config.json").read_text())


def read_mamba2_shape(raw: dict[str, Any], keys: dict[str, tuple[str, int]],
                      **known: int) -> Mamba2Shape:
    """A family's Mamba2 shape: `known` sizes, the rest by `keys` (field -> its config key
    and default; each family names them its own way)."""
    return Mamba2Shape(**known, **{field: raw.get(key, default)
                                   for field, (key, default) in keys.items()})


def read_dt_limit(raw: dict[str, Any]) -> tuple[float, float]:
    """time_step_limit: the bounds dt is clamped to after softplus."""
    low, high = raw.get("time_step_limit") or (0.0, float("inf"))
    return _json_float(low), _json_float(high)


def _json_float(value: float | dict[str, str]) -> float:
    """A float as transformers writes it to JSON: infinity as {"__float__": "Infinity"}."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 statistics and product, out in x's dtype (Nemotron-H's order; Bamba's rounds
    before the weight, the same in fp32 and within bf16 rounding)."""
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(
        x.dtype)


def _num_bytes(*holders: object) -> int:
    """Bytes of the tensors and linears `holders` keep as attributes."""
    return sum(value.num_bytes if isinstance(value, Linear)
               else value.numel() * value.element_size()
               for holder in holders for value in vars(holder).values()
               if isinstance(value, Linear | torch.Tensor))


class HybridForCausalLM:
    """The engine's model interface (as LlamaForCausalLM's) over a hybrid's layers."""

    def __init__(self, weights: WeightSource, mamba_shape: Mamba2Shape,
                 layers: list[HybridLayer], rotary: PartialRotary | None,
                 embed_tokens: torch.Tensor, final_norm: torch.Tensor, eps: float,
                 lm_head: torch.Tensor):
        self.mamba_shape = mamba_shape
        self.dtype, self.device = weights.dtype, weights.device
        self.rotary = rotary
        self.embed_tokens = embed_tokens
        self.layers = layers
        self.mamba_layers = [layer for layer in layers if isinstance(layer.mixer, Mamba2Mixer)]
        self.final_norm, self.eps = final_norm, eps
        self.lm_head = Linear(lm_head)
        self.num_bytes = _num_bytes(self, *layers, *(layer.mixer for layer in layers))
        self.small_batch_bytes = self.num_bytes   # no GGUF blocks: a step reads every weight
        self._step_states: tuple[list[Mamba2State], StateBatch] | None = None

    def allocate_states(self, num_slots: int,
                        ssm_dtype: torch.dtype = torch.float32) -> list[Mamba2State]:
        """Per Mamba layer, num_slots sequences' states."""
        return [Mamba2State.allocate(self.mamba_shape, num_slots, self.dtype, ssm_dtype,
                                     self.device) for _ in self.mamba_layers]

    def bind_kv_caches(self, kv_caches: list[KVCache]) -> None:
        attention = [layer.mixer for layer in self.layers
                     if isinstance(layer.mixer, HybridAttention)]
        for mixer, kv_cache in zip(attention, kv_caches, strict=True):
            mixer.kv_cache = kv_cache

    def set_step_states(self, states: list[Mamba2State], batch: StateBatch) -> None:
        """The Mamba layers' slots and the next forward pass's sequences in them."""
        assert len(states) == len(self.mamba_layers)
        self._step_states = states, batch

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: Any,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden_size] of the flattened batch input_ids [T]."""
        assert inputs_embeds is None, "a hybrid model takes no input embeddings"
        assert self._step_states is not None, "set_step_states before each forward pass"
        states, batch = self._step_states
        self._step_states = None   # NOTE: one pass per StateBatch: a stale one is never reused
        slots = iter(states)
        step = HybridStep(None if self.rotary is None else self.rotary.lookup(positions),
                          attn_metadata, batch)
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer in self.layers:
            state = next(slots) if isinstance(layer.mixer, Mamba2Mixer) else None
            hidden = layer.forward(hidden, step, state)
        return rms_norm(hidden, self.final_norm, self.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [rows, vocab]."""
        return self.lm_head(hidden).float()
