"""HF transformers baselines on this machine: static-batching `generate` and transformers'
own continuous batching (`generate_batch`), on random prompts of exact length.

    python -m benchmarks.hf --batch-sizes 1,8,32 --input-len 128 --output-len 128 \
        --dtype float32 [--continuous]

Prints one JSON line per measurement (output tokens/s over the whole generate call,
prefill included, as a client would see it).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from benchmarks.harness import print_preamble
from services.common.model_files import embedded_gguf_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_prompts(tokenizer: AutoTokenizer, count: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    special = set(tokenizer.all_special_ids)
    vocab = torch.tensor([i for i in range(len(tokenizer)) if i not in special])
    return vocab[torch.randint(len(vocab), (count, length), generator=generator)]


def static_batching(model: AutoModelForCausalLM, prompts: torch.Tensor, output_len: int) -> float:
    with torch.no_grad():
        started = time.perf_counter()
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts),
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             do_sample=False)
        elapsed = time.perf_counter() - started
    assert out.shape[1] == prompts.shape[1] + output_len
    return prompts.shape[0] * output_len / elapsed


def continuous_batching(model: AutoModelForCausalLM, prompts: torch.Tensor,
                        output_len: int) -> float:
    config = GenerationConfig(max_new_tokens=output_len, min_new_tokens=output_len,
                              do_sample=False, eos_token_id=-1)
    started = time.perf_counter()
    results = model.generate_batch(prompts.tolist(), generation_config=config, warmup=False)
    elapsed = time.perf_counter() - started
    generated = sum(len(r.generated_tokens) for r in results.values())
    return generated / elapsed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--continuous", action="store_true",
                        help="also measure transformers' continuous batching")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print_preamble()

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=DTYPES[args.dtype]).eval()
    static_batching(model, random_prompts(tokenizer, 1, 16, args.seed), 4)  # warm-up
    modes = [("static", static_batching)]
    if args.continuous:
        modes.append(("continuous", continuous_batching))
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        prompts = random_prompts(tokenizer, batch, args.input_len, args.seed + batch)
        for mode, run in modes:
            tok_s = run(model, prompts, args.output_len)
            print(json.dumps({"engine": f"hf-{mode}", "dtype": args.dtype, "batch": batch,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "output_tok_s": round(tok_s, 1)}), flush=True)


if __name__ == "__main__":
    main()
