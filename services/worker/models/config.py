"""The shape of a Llama-family model, read from an HF config.json (and generation_config.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    pass


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
    sliding_window: int | None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> ModelConfig:
        hf = json.loads((model_dir / "config.json").read_text())
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; the worker runs "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family) models")
        num_heads = hf["num_attention_heads"]
        rope_theta, rope_scaling = _rope_parameters(hf)
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
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            sliding_window=_sliding_window(hf),
            eos_token_ids=_eos_token_ids(model_dir, hf),
        )


def _rope_parameters(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 5's `rope_parameters` or the older split keys."""
    params = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling") or {}
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = {**legacy, **params}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    return theta, (None if rope_type == "default" else {**scaling, "rope_type": rope_type})


def _sliding_window(hf: dict[str, Any]) -> int | None:
    if hf.get("model_type") in ("qwen2", "qwen3") and not hf.get("use_sliding_window", False):
        return None
    return hf.get("sliding_window") or None


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
