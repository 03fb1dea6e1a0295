"""Benchmarks the worker's model runner in-process (no NATS): decode step time and prefill speed.

For each dtype: the decode step time at each batch size (requests with --prompt-len random
tokens, prefilled first, then --decode-steps steps of one token each), the memory-bandwidth
bound of a batch-1 step (weight bytes / measured read bandwidth), prefill tokens/s at
--max-num-batched-tokens per step, and where a decode step's time goes (input preparation,
forward with attention broken out, sampling, output packing). Medians throughout.

    .venv/bin/python scripts/bench_runner.py --dtypes float32,bfloat16 --batch-sizes 1,8,32,64
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import structlog
import torch

from services.common import wire
from services.common.model_files import resolve_model
from services.common.packing import pack_int32
from services.worker.model_runner import ModelRunner, RunnerConfig


@dataclass
class Driver:
    """A minimal scheduler: fixed-size requests, blocks handed out sequentially."""

    runner: ModelRunner
    prompt_len: int
    max_new_tokens: int
    step: int = 0
    next_block: int = 1
    num_computed: dict[int, int] = field(default_factory=dict)

    def add_and_prefill(self, handles: list[int], budget: int) -> list[float]:
        """Prefills the requests under the token budget; returns each step's seconds."""
        rng = np.random.default_rng(0)
        vocab = self.runner.info.vocab_size
        bs = self.runner.block_size
        blocks_per_req = -(-(self.prompt_len + self.max_new_tokens + 1) // bs)
        pending = []
        for h in handles:
            tokens = rng.integers(100, vocab - 100, self.prompt_len)
            blocks = range(self.next_block, self.next_block + blocks_per_req)
            self.next_block += blocks_per_req
            pending.append(wire.NewRequestData(
                handle=h, request_id=str(h), token_ids=pack_int32(tokens),
                num_prompt_tokens=self.prompt_len, block_ids=pack_int32(blocks),
                sampling=wire.SamplingParams(ignore_eos=True)))
        times, started = [], []
        while pending or any(self.num_computed[h] < self.prompt_len for h in started):
            new, new_sched, cached, cached_sched, left = [], [], [], [], budget
            for h in started:
                todo = min(self.prompt_len - self.num_computed[h], left)
                if todo > 0:
                    cached.append(h)
                    cached_sched.append(todo)
                    left -= todo
            while pending and left > 0:
                req = pending.pop(0)
                new.append(req)
                new_sched.append(min(self.prompt_len, left))
                self.num_computed[req.handle] = 0
                started.append(req.handle)
                left -= new_sched[-1]
            sched = new_sched + cached_sched
            out = self._run(new, cached, sched)
            times.append(out.execute_s)
        return times

    def decode(self, handles: list[int]) -> wire.StepOutput:
        return self._run([], handles, [1] * len(handles))

    def finish(self, handles: list[int]) -> None:
        self.runner.execute(wire.StepInput(step=self.step, finished_handles=pack_int32(handles)))
        for h in handles:
            del self.num_computed[h]
        self.next_block = 1

    def _run(self, new: list[wire.NewRequestData], cached: list[int],
             sched: list[int]) -> wire.StepOutput:
        step = wire.StepInput(
            step=self.step, new_requests=new, cached_handles=pack_int32(cached),
            cached_num_new_blocks=pack_int32([0] * len(cached)),
            cached_num_computed_tokens=pack_int32([self.num_computed[h] for h in cached]),
            num_scheduled_tokens=pack_int32(sched))
        out = self.runner.execute(step)
        if out.error:
            raise RuntimeError(out.error)
        for h, n in zip([r.handle for r in new] + cached, sched):
            self.num_computed[h] += n
        self.step += 1
        return out


class AttentionTimer:
    """Wraps the attention backend's forward to accumulate its wall time (CPU ops are sync)."""

    def __init__(self, runner: ModelRunner):
        self.seconds = 0.0
        backend = runner.attn_backend
        inner = backend.forward

        def timed(*args, **kwargs):
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - t
            return out

        backend.forward = timed


def read_bandwidth_gbs() -> float:
    """The machine's read bandwidth (GB/s): the best of a 512 MiB sum and a 256 MiB
    matrix-vector product (the read pattern of a batch-1 decode), median of 5 each."""
    x = torch.ones(128 * 2**20, dtype=torch.float32)
    weight, vector = x[:64 * 2**20].view(-1, 1024), torch.ones(1, 1024)

    def gbs(fn, num_bytes: int) -> float:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return num_bytes / statistics.median(times[1:]) / 1e9

    return max(gbs(x.sum, x.numel() * 4),
               gbs(lambda: torch.nn.functional.linear(vector, weight), weight.numel() * 4))


def bench_dtype(args: argparse.Namespace, model_dir: Path, dtype: str, bandwidth: float) -> None:
    started = time.perf_counter()
    runner = ModelRunner(RunnerConfig(
        model_dir=model_dir, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.prompt_len + args.decode_steps + 64,
        kv_cache_memory=args.kv_cache_gib * 2**30,
        max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend, num_threads=args.num_threads))
    kv_tokens = (runner.info.num_blocks - 1) * runner.info.block_size
    print(f"\n== {dtype} (kv cache {args.kv_cache_dtype}: {kv_tokens} tokens in "
          f"{args.kv_cache_gib} GiB, {runner.kv_spec.bytes_per_token} B/token; start-up "
          f"{time.perf_counter() - started:.1f} s, weights {runner.model.num_bytes / 1e6:.0f} MB)")
    timer = AttentionTimer(runner)
    driver = Driver(runner, args.prompt_len, args.decode_steps)
    bound_ms = runner.model.num_bytes / (bandwidth * 1e9) * 1e3
    for batch_size in args.batch_sizes:
        handles = list(range(batch_size))
        prefill_times = driver.add_and_prefill(handles, args.max_num_batched_tokens)
        phases: dict[str, list[float]] = {k: [] for k in
                                          ("step", "prepare", "forward", "attention", "sample",
                                           "output")}
        for _ in range(args.decode_steps):
            timer.seconds = 0.0
            out = driver.decode(handles)
            phases["step"].append(out.execute_s)
            phases["attention"].append(timer.seconds)
            for k, v in runner.last_step_timings.items():
                phases[k].append(v)
        med = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
        prefill_tps = batch_size * args.prompt_len / sum(prefill_times)
        line = (f"batch {batch_size:3d}: decode step {med['step']:6.1f} ms "
                f"({batch_size / med['step'] * 1e3:6.0f} tok/s)  prefill {prefill_tps:6.0f} tok/s"
                f" | prepare {med['prepare']:.2f} forward {med['forward']:.1f} "
                f"(attention {med['attention']:.1f}) sample {med['sample']:.2f} "
                f"output {med['output']:.2f} ms")
        if batch_size == 1:
            line += f" | bound {bound_ms:.1f} ms ({med['step'] / bound_ms:.2f}x)"
        print(line, flush=True)
        driver.finish(handles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="HF dir or GGUF (default: SmolLM2-135M)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--num-threads", type=int, default=None, help="default: all cores")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    model_dir = resolve_model(args.model).hf_dir
    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    bandwidth = read_bandwidth_gbs()
    print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads")
    for dtype in args.dtypes.split(","):
        bench_dtype(args, model_dir, dtype, bandwidth)


if __name__ == "__main__":
    main()
