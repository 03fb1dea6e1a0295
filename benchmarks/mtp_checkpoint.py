"""Writes a small random checkpoint in MiMo's MTP layout (a Qwen2 target whose
model.mtp_layers.0.* the worker's `--speculative-config '{"method": "mtp", ...}'` drafts
with), then compares MTP with n-gram, suffix and no speculation on it (spec_compare.py):

    python -m benchmarks.mtp_checkpoint --out bench-results/mtp-tiny --compare

No MTP checkpoint can be downloaded here, so this one is built: the path it proves (loading
the layout, drafting on the MTP layer's own KV, verification) is a real checkpoint's, while
its tok/s say nothing of a real model's.

- `--mtp random`: random MTP weights (the drafts are mostly rejected).
- `--mtp bigram` (default): an MTP layer whose draft is the target's greedy next token as the
  token alone would have it: input_proj reads only the embedding half, the block adds
  nothing (o_proj and down_proj zero), final_layernorm is the target's final norm. The
  target's layers are scaled by `--layer-scale`: at 0 it is a bigram model and every draft
  is accepted; above 0 its context moves its choice, and drafts are accepted less often.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

MTP_PREFIX = "model.mtp_layers.0."
_ZEROED_IN_BIGRAM = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def save_mimo_checkpoint(directory: Path, shape: dict, mtp: str = "bigram",
                         layer_scale: float = 1.0, seed: int = 0
                         ) -> tuple[transformers.PreTrainedModel, dict[str, torch.Tensor]]:
    """Saves the Qwen2 target (its layers' output projections times layer_scale) as MiMo
    with one MTP layer; returns the target (fp32, eval) and the MTP tensors as saved."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**shape, tie_word_embeddings=False)
    target = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(layer_scale)
            layer.mlp.down_proj.weight.mul_(layer_scale)
    target.save_pretrained(directory)
    block = transformers.Qwen2Config(**{**shape, "num_hidden_layers": 1})
    block_model = transformers.AutoModel.from_config(block, dtype=torch.float32)
    tensors = {MTP_PREFIX + name.removeprefix("layers.0."): value.detach().clone()
               for name, value in block_model.state_dict().items()
               if name.startswith("layers.0.")}
    hidden = shape["hidden_size"]
    if mtp == "bigram":
        for name in _ZEROED_IN_BIGRAM:
            tensors[MTP_PREFIX + name].zero_()
        own = {"token_layernorm.weight": torch.ones(hidden),
               "hidden_layernorm.weight": torch.ones(hidden),
               "input_proj.weight": torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)),
                                              dim=1),
               "final_layernorm.weight": target.model.norm.weight.detach().clone()}
    else:
        own = {"token_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
               "hidden_layernorm.weight": 1 + 0.1 * torch.randn(hidden),
               "input_proj.weight": 0.1 * torch.randn(hidden, 2 * hidden),
               "final_layernorm.weight": 1 + 0.1 * torch.randn(hidden)}
    tensors |= {MTP_PREFIX + name: value for name, value in own.items()}
    weights = directory / "model.safetensors"
    save_file(load_file(weights) | tensors, weights, metadata={"format": "pt"})
    hf = json.loads((directory / "config.json").read_text())
    hf |= {"architectures": ["MiMoForCausalLM"], "model_type": "mimo",
           "num_nextn_predict_layers": 1}
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    return target, tensors


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/mtp-tiny"))
    parser.add_argument("--mtp", choices=("bigram", "random"), default="bigram")
    parser.add_argument("--layer-scale", type=float, default=0.005)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--compare", action="store_true",
                        help="then serve random prompts with no speculation, n-gram, suffix "
                             "and MTP")
    parser.add_argument("--compare-prompts", type=int, default=8,
                        help="prompts at concurrency 1 (twice as many at 8)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--num-speculative-tokens", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3,
                        help="times each prompt group is served per method; the fastest counts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from benchmarks.harness import print_preamble
    from benchmarks.spec_compare import compare
    from services.common.speculative_config import SpeculativeConfig
    print_preamble()
    shape = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                 intermediate_size=3 * args.hidden_size, num_hidden_layers=args.num_layers,
                 num_attention_heads=args.hidden_size // 64, num_key_value_heads=2,
                 head_dim=64, max_position_embeddings=2048, initializer_range=0.1,
                 rms_norm_eps=1e-6, eos_token_id=2)
    args.out.mkdir(parents=True, exist_ok=True)
    save_mimo_checkpoint(args.out, shape, args.mtp, args.layer_scale, args.seed)
    print(f"wrote {args.out}")
    if not args.compare:
        return
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, args.vocab_size, (args.prompt_len,), generator=generator).tolist()
               for _ in range(3 * args.compare_prompts)]
    methods = {"none": None,
               "ngram": SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4),
               "suffix": SpeculativeConfig("suffix", 4),
               "mtp": SpeculativeConfig("mtp", args.num_speculative_tokens)}
    compare(args.out, methods, prompts, args.compare_prompts, args.max_new_tokens, args.seed,
            args.repeats)


if __name__ == "__main__":
    main()
