"""Scheduler CPU cost per step, with a fake executor (no model, no NATS).

1. Steady decode: N running requests each decoding one token per step; the time of
   schedule() + update_from_output() per step (median, P99). Goal: < 2 ms at N = 256.
2. Prefix caching on vs off at a 0% hit rate (every prompt unique): scheduler time for a
   whole workload (admission with prompt hashing, chunked prefills, decodes), as tokens per
   second of scheduler CPU. The loss shown is relative to the scheduler alone; the engine's
   loss is this added time over the model's step time.

Run: .venv/bin/python -m benchmarks.scheduler [--num-running 256 --steps 2000]
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Sequence

from benchmarks.harness import distribution, print_preamble
from services.scheduler.core import Request, RunnerOutput, Scheduler, SchedulerConfig


def fake_execute(out) -> RunnerOutput:
    """Every request whose scheduled tokens reach its end samples a token; a partial prefill
    would not, but the decode bench has none and the workload bench tracks them below."""
    handles = out.scheduled_handles
    return RunnerOutput(handles, [(h * 7 + out.step) % 30000 + 100 for h in handles])


class PrefillAwareExecutor:
    """Samples only for requests whose prefill is complete (as the worker does)."""

    def __init__(self) -> None:
        self.remaining: dict[int, int] = {}   # handle -> tokens still to run

    def __call__(self, out) -> RunnerOutput:
        for handle in out.finished_handles:
            self.remaining.pop(handle, None)
        for new in out.new_requests:
            self.remaining[new.handle] = len(new.token_ids) - new.num_computed_tokens
        handles, tokens = [], []
        for handle, num_tokens in zip(out.scheduled_handles, out.num_scheduled_tokens):
            left = self.remaining[handle] - num_tokens
            if left == 0:
                handles.append(handle)
                tokens.append((handle * 7 + out.step) % 30000 + 100)
                left = 1   # the sampled token runs next step
            self.remaining[handle] = left
        return RunnerOutput(handles, tokens)


def bench_decode(num_running: int, steps: int, prompt_len: int, caching: bool,
                 hash_algo: str) -> dict[str, float]:
    budget = max(512, num_running)
    # Long enough that nobody finishes during the prefill warm-up or the timed steps.
    max_tokens = steps + num_running * prompt_len // budget + 64
    max_model_len = prompt_len + max_tokens
    blocks_per_request = -(-max_model_len // 16)
    config = SchedulerConfig(max_num_seqs=num_running, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_prefix_caching=caching,
                             hash_algo=hash_algo, policy="fcfs", async_scheduling=False,
                             num_gpu_blocks=num_running * blocks_per_request + 1)
    scheduler = Scheduler(config)
    rng = random.Random(0)
    for i in range(num_running):
        prompt = [rng.randrange(100, 30000) for _ in range(prompt_len)]
        scheduler.add_request(Request(f"r{i}", prompt, max_tokens=max_tokens, arrival_time=0.0,
                                      block_hasher=scheduler.block_hasher))
    # Prefill everyone, then time pure decode steps.
    executor = PrefillAwareExecutor()
    while any(r.num_tokens - r.num_computed_tokens != 1 for r in scheduler.running) or \
            scheduler.num_waiting:
        out = scheduler.schedule()
        scheduler.update_from_output(out, executor(out))
    schedule_ns, update_ns, total_ns = [], [], []
    gc.collect()
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        out = scheduler.schedule()
        t1 = time.perf_counter_ns()
        runner_output = fake_execute(out)
        t2 = time.perf_counter_ns()
        scheduler.update_from_output(out, runner_output)
        t3 = time.perf_counter_ns()
        assert len(out.cached.handles) == num_running
        schedule_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        total_ns.append(t1 - t0 + t3 - t2)
    total = distribution([ns * 1e-9 for ns in total_ns])
    return {"median_ms": total.p50, "p99_ms": total.p99,
            "schedule_median_ms": distribution([ns * 1e-9 for ns in schedule_ns]).p50,
            "update_median_ms": distribution([ns * 1e-9 for ns in update_ns]).p50}


def bench_workload(caching: bool, num_requests: int, prompt_len: int, max_tokens: int,
                   hash_algo: str) -> tuple[float, int, int]:
    """Scheduler seconds (admission + schedule + update) for a 0%-hit workload."""
    # Room for every running request: a preempted one would hit its own kept prefix.
    num_blocks = 256 * -(-(prompt_len + max_tokens) // 16) + 1
    config = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=2048,
                             max_model_len=prompt_len + max_tokens, enable_prefix_caching=caching,
                             hash_algo=hash_algo, policy="fcfs", async_scheduling=False,
                             num_gpu_blocks=max(8192, num_blocks))
    scheduler = Scheduler(config)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 30000) for _ in range(prompt_len)] for _ in range(num_requests)]
    executor = PrefillAwareExecutor()
    gc.collect()
    elapsed = 0.0
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        scheduler.add_request(Request(f"r{i}", prompt, max_tokens=max_tokens, arrival_time=0.0,
                                      block_hasher=scheduler.block_hasher))
    elapsed += time.perf_counter() - start
    num_steps = 0
    while scheduler.has_unfinished_requests():
        start = time.perf_counter()
        out = scheduler.schedule()
        elapsed += time.perf_counter() - start
        runner_output = executor(out)
        start = time.perf_counter()
        scheduler.update_from_output(out, runner_output)
        elapsed += time.perf_counter() - start
        num_steps += 1
    assert scheduler.make_stats().prefix_cache_hits == 0
    return elapsed, num_steps, num_requests * (prompt_len + max_tokens)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-running", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--hash-algo", default="sha256", choices=["sha256", "xxh3_128"])
    parser.add_argument("--workload-requests", type=int, default=512)
    parser.add_argument("--workload-prompt-len", type=int, default=512)
    parser.add_argument("--workload-max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print_preamble()

    print(f"1. steady decode, {args.num_running} running, {args.steps} steps, "
          f"prompt {args.prompt_len}, hash {args.hash_algo}, the run with the best median "
          f"of {args.repeats} (the machine is shared)")
    for caching in (True, False):
        result = min((bench_decode(args.num_running, args.steps, args.prompt_len, caching,
                                   args.hash_algo) for _ in range(args.repeats)),
                     key=lambda r: r["median_ms"])
        print(f"   prefix caching {'on ' if caching else 'off'}: per step median "
              f"{result['median_ms']:.3f} ms, P99 {result['p99_ms']:.3f} ms "
              f"(schedule {result['schedule_median_ms']:.3f} ms, "
              f"update {result['update_median_ms']:.3f} ms)")

    print(f"2. 0% prefix-hit workload: {args.workload_requests} unique prompts of "
          f"{args.workload_prompt_len} tokens, {args.workload_max_tokens} output tokens each, "
          f"budget 2048, best of {args.repeats}")
    best = {}
    for caching in (True, False):
        runs = [bench_workload(caching, args.workload_requests, args.workload_prompt_len,
                               args.workload_max_tokens, args.hash_algo)
                for _ in range(args.repeats)]
        seconds, num_steps, num_tokens = min(runs)
        best[caching] = seconds
        print(f"   prefix caching {'on ' if caching else 'off'}: {seconds * 1e3:.1f} ms scheduler "
              f"time, {num_steps} steps ({seconds / num_steps * 1e3:.3f} ms/step), "
              f"{num_tokens / seconds / 1e6:.2f} M tokens/s of scheduler CPU")
    added = best[True] - best[False]
    print(f"   caching adds {added * 1e3:.1f} ms over the workload "
          f"({added / best[False] * 100:.1f}% of the scheduler's own time)")


if __name__ == "__main__":
    main()
