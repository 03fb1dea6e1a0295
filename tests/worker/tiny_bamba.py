"""A tiny random Bamba checkpoint built by transformers' own BambaForCausalLM, saved as an HF
directory the worker loads (with the embedded model's tokenizer where a mesh needs one)."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

from services.common.model_files import resolve_model


def save_tiny_bamba(directory: Path, with_tokenizer: bool = False,
                    max_position_embeddings: int = 512) -> transformers.BambaForCausalLM:
    """A 4-layer Bamba (attention at layer 1; 8 Mamba heads in 2 groups; a scan chunk of 8
    tokens, so prompts span several) saved to `directory`; returns it (fp32, eval). Without a
    tokenizer its vocabulary is 256 tokens and it has no EOS; with one, the embedded model's
    tokenizer (saved beside it) sets the vocabulary and EOS."""
    vocab = dict(vocab_size=256, eos_token_id=None)
    tokenizer = None
    if with_tokenizer:
        tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model("").hf_dir)
        vocab = dict(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                     bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id)
    config = transformers.BambaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=16,
        mamba_n_groups=2, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        initializer_range=0.1, max_position_embeddings=max_position_embeddings, **vocab)
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(config).eval()
    with torch.no_grad():
        # NOTE: HF initializes norms to one, D and dt_bias to one, A_log to log(1..H): noise on
        # every parameter keeps a wrong index or a missing term from hiding behind a constant.
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return model
