"""The shape of a decoder-only model, read from an HF config.json (and generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3",
                         "mixtral", "qwen2_moe", "qwen3_moe", "bamba", "nemotron_h")
# Hybrids: Mamba2 layers beside a few attention layers (docs/hybrid_models.md).
HYBRID_MODEL_TYPES = ("bamba", "nemotron_h")
# Nemotron-H's layer kinds as its hybrid_override_pattern spells them.
NEMOTRON_H_LAYER_CHARS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
# Vision-language checkpoints: the text model they hold runs as this model_type, beside the
# vision tower (vision/registry.py).
VISION_MODEL_TYPE_TO_TEXT = {"qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "idefics3": "llama",
                             "smolvlm": "llama"}
# Checkpoints that run as another model_type: MiMo is Qwen2 plus MTP layers, which only
# speculative decoding reads (spec_decode/mtp_head.py).
MODEL_TYPE_ALIASES = {"mimo": "qwen2"}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (Mixtral, Qwen2-MoE): which layers have one, and its shape."""
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int                 # each expert's
    norm_topk_prob: bool                   # renormalize the top-k routing weights to sum to 1
    shared_expert_intermediate_size: int   # Qwen2-MoE's always-on expert; 0: none
    sparse_layers: tuple[bool, ...]        # per layer: experts (True) or the dense MLP


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool            # qwen2: bias on q/k/v
    qk_norm: bool                   # qwen3: RMSNorm over each head of q and k before rope
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    # Per layer: its sliding window, or None for a global (full-context) layer.
    layer_sliding_windows: tuple[int | None, ...]
    eos_token_ids: list[int] = field(default_factory=list)
    hidden_act: str = "silu"
    attention_scale: float | None = None           # None: head_dim ** -0.5
    attn_logit_softcapping: float | None = None    # Gemma 2: cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None   # Gemma 2: the same on the logits
    local_rope_theta: float | None = None          # Gemma 3: sliding layers' rope base
    moe: MoEConfig | None = None
    vision_model_type: str | None = None           # a VLM's model_type (images enabled)
    mrope_section: tuple[int, ...] | None = None   # Qwen2-VL's M-RoPE (vision/mrope.py)
    # A hybrid's attention layers (the rest keep a recurrent state); None: every layer.
    hybrid_attention_layers: tuple[int, ...] | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_attention_layers is not None

    @property
    def num_attention_layers(self) -> int:
        """The layers with KV in the paged cache."""
        return (self.num_hidden_layers if self.hybrid_attention_layers is None
                else len(self.hybrid_attention_layers))

    @property
    def max_context(self) -> int:
        """The longest context the model serves: max_position_embeddings, or what its rope
        scaling extends it to (vLLM's rule: yarn from the original context, dynamic NTK from
        max_position_embeddings, times the factor)."""
        rope_type = (self.rope_scaling or {}).get("rope_type")
        if rope_type == "yarn":
            scaling = self.rope_scaling
            return max(self.max_position_embeddings,
                       int(scaling["original_max_position_embeddings"] * scaling["factor"]))
        if rope_type == "dynamic":
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        return self.max_position_embeddings

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.attention_scale or self.head_dim ** -0.5

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        hf = json.loads((model_dir / "config.json").read_text())
        model_type = hf.get("model_type", "")
        model_type = MODEL_TYPE_ALIASES.get(model_type, model_type)
        hf = {**hf, "model_type": model_type}
        vision_model_type = model_type if model_type in VISION_MODEL_TYPE_TO_TEXT else None
        if vision_model_type is not None:
            # NOTE: transformers 5 nests the text model's keys in text_config; older Qwen2-VL
            # configs keep them at the top level.
            model_type = VISION_MODEL_TYPE_TO_TEXT[vision_model_type]
            hf = {**hf, **(hf.get("text_config") or {}), "model_type": model_type}
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; the worker runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES + tuple(VISION_MODEL_TYPE_TO_TEXT))} models")
        if model_type == "nemotron_h":
            hf = {**hf, "num_hidden_layers": len(nemotron_h_pattern(hf))}
        num_heads = hf["num_attention_heads"]
        is_hybrid = model_type in HYBRID_MODEL_TYPES
        # NOTE: Bamba rotates half of each head; its model applies that rope itself.
        rope_theta, rope_scaling, local_rope_theta = _rope_parameters(
            hf, allow_partial_rotary=is_hybrid)
        mrope_section = None
        if rope_scaling is not None and "mrope_section" in rope_scaling:
            mrope_section = tuple(rope_scaling.pop("mrope_section"))
            rope_scaling = None if rope_scaling["rope_type"] == "default" else rope_scaling
        query_pre_attn_scalar = hf.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            # NOTE: Qwen2 configs carry no flag for their q/k/v bias; it is part of the arch.
            attention_bias=hf.get("attention_bias", hf.get("qkv_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            layer_sliding_windows=_layer_sliding_windows(hf),
            eos_token_ids=_eos_token_ids(model_dir, hf),
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            attention_scale=(None if query_pre_attn_scalar is None
                             else float(query_pre_attn_scalar) ** -0.5),
            attn_logit_softcapping=hf.get("attn_logit_softcapping") or None,
            final_logit_softcapping=hf.get("final_logit_softcapping") or None,
            local_rope_theta=local_rope_theta,
            moe=_moe_config(hf),
            vision_model_type=vision_model_type,
            mrope_section=mrope_section,
            hybrid_attention_layers=_hybrid_attention_layers(hf) if is_hybrid else None,
        )


def nemotron_h_pattern(hf: dict[str, Any]) -> str:
    """Nemotron-H's layers, one char each: M Mamba2, * attention, - MLP, E MoE (transformers 5
    writes them as the list layers_block_type, older checkpoints as hybrid_override_pattern)."""
    layer_types = hf.get("layers_block_type")
    if layer_types:
        return "".join(NEMOTRON_H_LAYER_CHARS[t] for t in layer_types)
    return hf["hybrid_override_pattern"]


def _hybrid_attention_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    if hf["model_type"] == "nemotron_h":
        return tuple(i for i, kind in enumerate(nemotron_h_pattern(hf)) if kind == "*")
    return tuple(hf.get("attn_layer_indices") or ())


def _rope_parameters(hf: dict[str, Any], allow_partial_rotary: bool = False
                     ) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling, local theta) from transformers 5's `rope_parameters` or the older split
    keys. Gemma 3 keeps one set per layer type: full layers' is the model's, sliding layers'
    gives the local theta (their scaling is always default)."""
    params = dict(hf.get("rope_parameters") or {})
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in params:
        local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
        params = dict(params["full_attention"])
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "mrope":   # older Qwen2-VL configs: default rope over M-RoPE positions
        rope_type = "default"
    partial = scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0 and not allow_partial_rotary:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if rope_type in ("su", "longrope", "yarn"):
        # NOTE: Phi-3 keeps the pretraining context beside the extended one; their ratio is
        # the scaling factor where the config names none.
        rope_type = "longrope" if rope_type == "su" else rope_type
        original = scaling.get("original_max_position_embeddings",
                               hf.get("original_max_position_embeddings",
                                      hf["max_position_embeddings"]))
        if scaling.get("factor") is None:
            scaling["factor"] = hf["max_position_embeddings"] / original
        scaling["original_max_position_embeddings"] = original
    if rope_type == "dynamic":
        # Dynamic NTK grows the base past max_position_embeddings (rotary.py).
        scaling["max_position_embeddings"] = hf["max_position_embeddings"]
    keep = rope_type != "default" or "mrope_section" in scaling
    return (theta, {**scaling, "rope_type": rope_type} if keep else None,
            None if local_theta is None else float(local_theta))


def _layer_sliding_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window: `layer_types` where the config has them (transformers writes them
    for Gemma 2 / 3 and the Qwens), else the arch's pattern; Qwens slide only with
    use_sliding_window."""
    model_type, num_layers = hf.get("model_type"), hf["num_hidden_layers"]
    window = hf.get("sliding_window") or None
    if window is None or (model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
                          and not hf.get("use_sliding_window", False)):
        return (None,) * num_layers
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = {"gemma2": 2, "gemma3_text": hf.get("sliding_window_pattern", 6)}.get(
            model_type)
        max_window_layers = (hf.get("max_window_layers", 0)
                             if model_type in ("qwen2", "qwen3") else 0)
        layer_types = ["full_attention" if (pattern and (i + 1) % pattern == 0)
                       or i < max_window_layers else "sliding_attention"
                       for i in range(num_layers)]
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _moe_config(hf: dict[str, Any]) -> MoEConfig | None:
    """Mixtral's num_local_experts or the Qwen MoEs' num_experts, with their dense layers
    (mlp_only_layers, decoder_sparse_step); Mixtral always renormalizes its top-k."""
    num_experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not num_experts:
        return None
    step = hf.get("decoder_sparse_step") or 1
    dense = set(hf.get("mlp_only_layers") or [])
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=hf["num_experts_per_tok"],
        intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", hf.get("model_type") == "mixtral")),
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0
                            for i in range(hf["num_hidden_layers"])))


def _eos_token_ids(model_dir: Path, hf: dict[str, Any]) -> list[int]:
    """EOS ids from generation_config.json (what generate stops on), else config.json."""
    eos: Any = None
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]
