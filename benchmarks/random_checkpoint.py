"""A checkpoint of random weights in a real model's shape, with the embedded model's tokenizer
files: what a machine gets that the embedded model's weights cannot reach (a lent GPU reaches
no registry, and what travels there is capped at 64 MiB), for benchmarks whose timings do
not depend on the values (scripts/gpu_check.sh).

    python -m benchmarks.random_checkpoint --shape llama3-8b --tokenizer .gpu/tokenizer \
        --out /tmp/llama3-8b --device cuda --dtype bfloat16

The vocabulary is the tokenizer's (49,152 tokens for SmolLM2's), so every sampled id decodes;
in the Llama-3-8B shape the embedding and LM head are then 2.6x smaller than Llama 3's 128,256
rows: 7.38 B parameters instead of 8.03 B. Weights are drawn on --device (seconds on a GPU)
and saved as safetensors in --dtype.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import tokenizers
import torch
import transformers

# LlamaConfig fields of each shape (HF's config.json of the real model).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=8192, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", rope_theta=100000.0),
                         tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters=dict(rope_type="default", rope_theta=500000.0),
                      tie_word_embeddings=False),
    # The CPU dry run of the GPU check: the same files and flow in seconds.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                 rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1e4),
                 tie_word_embeddings=True),
}
# What the tokenizer service, the chat template and the sampler's EOS read from the model dir.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def token_ids(tokenizer_dir: Path) -> dict[str, int]:
    """vocab_size, bos / eos / pad ids of the tokenizer, for the model's config."""
    size = tokenizers.Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    generation = json.loads((tokenizer_dir / "generation_config.json").read_text())
    return dict(vocab_size=size, **{k: generation[k] for k in
                                    ("bos_token_id", "eos_token_id", "pad_token_id")
                                    if k in generation})


def build(shape: str, tokenizer_dir: Path, out: Path, device: str, dtype: torch.dtype,
          seed: int = 0) -> int:
    """Writes the checkpoint and the tokenizer files to `out`; returns its parameter count."""
    config = transformers.LlamaConfig(**SHAPES[shape], **token_ids(tokenizer_dir))
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size="5GB")
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), required=True)
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a directory with the tokenizer files (TOKENIZER_FILES)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        default="bfloat16")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    params = build(args.shape, args.tokenizer, args.out, args.device,
                   getattr(torch, args.dtype))
    print(f"{args.shape}: {params / 1e9:.3f} B parameters ({args.dtype}) in {args.out}, "
          f"{time.perf_counter() - started:.1f} s", flush=True)


if __name__ == "__main__":
    main()
