"""What the worker's warm-up buys: the first request after start-up against the second, with
and without the warm-up, in-process (no NATS).

Each run builds a fresh ModelRunner in its own process (oneDNN's kernels and the allocator's
pools start cold), then prefills a --prompt-len prompt in --max-num-batched-tokens chunks and
decodes 4 tokens, twice. Prints each run's load time (the warm-up included) and both
requests' prefill time; medians over --repeats runs.

    .venv/bin/python -m benchmarks.first_request --dtypes float32,bfloat16 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from benchmarks.harness import REPO_ROOT, print_preamble

NUM_DECODE_STEPS = 4


def one_run(dtype: str, warm_up: bool, prompt_len: int, budget: int) -> dict[str, float]:
    """Load, then two requests in turn: seconds of each phase."""
    from benchmarks.runner import Driver
    from services.common.model_files import resolve_model
    from services.worker.runner.model_runner import ModelRunner, RunnerConfig
    from services.worker.runner.warm_up import warm_up as run_warm_up

    files = resolve_model("")
    started = time.perf_counter()
    runner = ModelRunner(RunnerConfig(
        model_dir=files.hf_dir, dtype=dtype, kv_cache_memory=2**28,
        max_num_batched_tokens=budget, max_model_len=2048))
    if warm_up:
        run_warm_up(runner)
    times = {"load": time.perf_counter() - started}
    for name in ("first", "second"):
        driver = Driver(runner, prompt_len=prompt_len, max_new_tokens=NUM_DECODE_STEPS + 1)
        started = time.perf_counter()
        driver.add_and_prefill([1], budget)
        times[name] = time.perf_counter() - started
        for _ in range(NUM_DECODE_STEPS):
            driver.decode([1])
        driver.finish([1])
    return times


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=910)
    parser.add_argument("--max-num-batched-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, metavar=("DTYPE", "WARM_UP"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        dtype, warm_up = args.child
        print(json.dumps(one_run(dtype, warm_up == "1", args.prompt_len,
                                 args.max_num_batched_tokens)))
        return
    print_preamble()
    print("| dtype | warm-up | load s | first request prefill ms | second request prefill ms |\n"
          "|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for warm_up in ("0", "1"):
            runs = [json.loads(subprocess.run(
                [sys.executable, "-m", "benchmarks.first_request", "--prompt-len",
                 str(args.prompt_len), "--max-num-batched-tokens",
                 str(args.max_num_batched_tokens), "--child", dtype, warm_up],
                check=True, capture_output=True, text=True, cwd=REPO_ROOT).stdout.splitlines()[-1])
                for _ in range(args.repeats)]

            def median(key: str) -> float:
                return statistics.median(run[key] for run in runs)
            print(f"| {dtype} | {'yes' if warm_up == '1' else 'no'} | {median('load'):.2f} | "
                  f"{1e3 * median('first'):,.0f} | {1e3 * median('second'):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
