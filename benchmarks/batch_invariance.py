"""Batch invariance (issue 47, --batch-invariant): how often a request's tokens and logprobs
change with its batchmates, and what the flag costs.

Each prompt runs alone (a step budget of --alone-budget tokens chunks its prefill one way),
then the same prompts are shuffled into batches of --batch-sizes (1 to 32 requests, a budget
of --mixed-budget: other batchmates, positions and chunk boundaries). Greedy, with the
logprob of every sampled token. Printed per mode (flag off, then on): the prompts whose
tokens differ between the two runs, those whose logprobs differ bit for bit, and the
generated tokens per second of the mixed runs and of the alone runs (batch 1).

    .venv/bin/python -m benchmarks.batch_invariance --dtype bfloat16
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Sequence

import structlog
import torch

from benchmarks.harness import print_preamble
from services.common.model_files import resolve_model
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from tests.worker.batch_mix import num_differing, random_prompts, run_alone, run_mixed


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--batch-sizes", default="1,2,3,4,8,32")
    parser.add_argument("--min-len", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--alone-budget", type=int, default=48)
    parser.add_argument("--mixed-budget", type=int, default=128)
    parser.add_argument("--modes", default="off,on", help="flag off and/or on")
    args = parser.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    print_preamble()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    model_dir = resolve_model(args.model).hf_dir
    print(f"{args.num_prompts} prompts of {args.min_len}-{args.max_len} tokens, "
          f"{args.max_new_tokens} greedy tokens each, {args.dtype}, {torch.get_num_threads()} "
          f"threads; alone at a {args.alone_budget}-token step budget, mixed in batches of "
          f"{batch_sizes} at {args.mixed_budget}")
    print("| --batch-invariant | tokens differ | logprobs differ | mixed tok/s | alone tok/s |")
    print("|---|---|---|---|---|")
    for mode in args.modes.split(","):
        runner = ModelRunner(RunnerConfig(
            model_dir=model_dir, dtype=args.dtype, kv_cache_memory=256 * 1024**2,
            max_model_len=args.max_len + args.max_new_tokens + 16, max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(args.alone_budget, args.mixed_budget),
            batch_invariant=mode == "on"))
        prompts = random_prompts(args.num_prompts, runner.info.vocab_size, args.min_len,
                                 args.max_len)
        run_alone(runner, prompts[:2], 2, args.alone_budget)   # warm-up
        alone = run_alone(runner, prompts, args.max_new_tokens, args.alone_budget)
        mixed = run_mixed(runner, prompts, batch_sizes, args.max_new_tokens, args.mixed_budget)
        tokens, logprobs = num_differing(alone.outputs, mixed.outputs)
        print(f"| {mode} | {tokens}/{args.num_prompts} | {logprobs}/{args.num_prompts} | "
              f"{mixed.num_tokens / mixed.seconds:.1f} | {alone.num_tokens / alone.seconds:.1f} |",
              flush=True)
        runner.close()
        del runner
        gc.collect()


if __name__ == "__main__":
    main()
