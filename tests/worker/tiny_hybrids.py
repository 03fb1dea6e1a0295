"""Tiny random hybrid checkpoints built by transformers' own model classes (BambaForCausalLM,
NemotronHForCausalLM), saved as HF directories the worker loads (with the embedded model's
tokenizer where a mesh needs one). Both have one attention layer of 2 KV heads x 16 dims (256 B
of fp32 KV a token) and Mamba2 layers of 8 heads x 16 in 2 groups with a scan chunk of 8 tokens,
so prompts span several."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from services.common.model_files import resolve_model

MAMBA2 = dict(mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8)


def save_tiny_bamba(directory: Path, with_tokenizer: bool = False,
                    max_position_embeddings: int = 512) -> transformers.BambaForCausalLM:
    """A 4-layer Bamba (attention at layer 1) saved to `directory`; returns it (fp32, eval)."""
    return _save(directory, with_tokenizer, lambda vocab: transformers.BambaForCausalLM(
        transformers.BambaConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_expand=2,
            initializer_range=0.1, max_position_embeddings=max_position_embeddings,
            **MAMBA2, **vocab)))


def save_tiny_nemotron_h(directory: Path, with_tokenizer: bool = False,
                         max_position_embeddings: int = 512
                         ) -> transformers.NemotronHForCausalLM:
    """A 6-layer Nemotron-H, pattern "M*-M-M" (Mamba2, attention, MLP, Mamba2, MLP, Mamba2),
    saved to `directory`; returns it (fp32, eval)."""
    def build(vocab: dict[str, Any]) -> transformers.NemotronHForCausalLM:
        model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
            hidden_size=64, intermediate_size=96, hybrid_override_pattern="M*-M-M",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8,
            mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=8,
            initializer_range=0.1, max_position_embeddings=max_position_embeddings, **vocab))
        with torch.no_grad():
            # NOTE: HF starts dt_bias at softplus⁻¹ of 0.001..0.1, where transformers 5 clamps a
            # prefill's dt at time_step_min (0.001) but not a decode's, and vLLM neither: from
            # Bamba's 1, dt stays far above it, so every rule computes the same model.
            for layer in model.model.layers:
                if layer.block_type == "linear_attention":
                    layer.mixer.dt_bias.fill_(1.0)
        return model
    return _save(directory, with_tokenizer, build)


# The families tests run alike: a save function and transformers' class that reloads it.
HYBRID_FAMILIES: dict[str, tuple[Callable[..., transformers.PreTrainedModel],
                                 type[transformers.PreTrainedModel]]] = {
    "bamba": (save_tiny_bamba, transformers.BambaForCausalLM),
    "nemotron_h": (save_tiny_nemotron_h, transformers.NemotronHForCausalLM),
}


def _save(directory: Path, with_tokenizer: bool,
          build: Callable[[dict[str, Any]], transformers.PreTrainedModel]
          ) -> transformers.PreTrainedModel:
    """Builds the model (seeded) for a vocabulary, adds noise, saves it. Without a tokenizer its
    vocabulary is 256 tokens and it has no EOS; with one, the embedded model's tokenizer (saved
    beside it) sets the vocabulary and EOS."""
    vocab: dict[str, Any] = dict(vocab_size=256, eos_token_id=None)
    tokenizer = None
    if with_tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("").hf_dir)
        vocab = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = build(vocab).eval()
    with torch.no_grad():
        # NOTE: HF initializes norms to one, D and dt_bias to one, A_log to log(1..H): noise on
        # every parameter keeps a wrong index or a missing term from hiding behind a constant.
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return model
