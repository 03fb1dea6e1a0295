"""Makes LoRA adapters for the embedded model to benchmark multi-LoRA serving with: PEFT
directories with seeded random (non-zero) A and B on the chosen projections (all seven by
default; PEFT's own default for Llama is rank 8 on q_proj and v_proj), and prints the
`--lora-modules` flags that serve them.

    python -m benchmarks.make_lora_adapters /tmp/adapters --count 4 --rank 16
    python -m benchmarks.make_lora_adapters /tmp/adapters-qv --rank 8 --targets q_proj v_proj
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model

from services.common.model_files import resolve_model

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base: transformers.PreTrainedModel, out_dir: Path, rank: int,
                 targets: list[str], seed: int) -> None:
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=2 * rank,
                                            target_modules=targets))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():   # PEFT starts B at zero: an adapter that changes nothing
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.save_pretrained(out_dir)
    model.unload()   # the base's linears back, for the next adapter


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--count", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=PROJECTIONS, choices=PROJECTIONS,
                        help="projections the adapters change")
    args = parser.parse_args(argv)
    base = transformers.AutoModelForCausalLM.from_pretrained(resolve_model("").hf_dir,
                                                             dtype=torch.float32)
    flags = []
    for index in range(args.count):
        name = f"adapter{index}"
        make_adapter(base, args.out_dir / name, args.rank, args.targets, seed=index)
        flags += ["--lora-modules", f"{name}={args.out_dir / name}"]
    print(" ".join(flags))


if __name__ == "__main__":
    main()
