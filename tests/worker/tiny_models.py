"""Tiny random Llama-family models, saved as HF directories the ModelRunner can load."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, initializer_range=0.1, rms_norm_eps=1e-6,
            eos_token_id=2)
VARIANTS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=True)),
    "llama3_rope": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
    "linear_rope": (transformers.LlamaConfig, dict(rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None)),
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (transformers.Qwen3Config, dict()),
}


def save_tiny_model(name: str, directory: Path) -> transformers.PreTrainedModel:
    """Builds the random model (seeded), saves it to `directory` and returns it (fp32, eval)."""
    config_cls, extra = VARIANTS[name]
    config = config_cls(**TINY, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(directory)
    return model
