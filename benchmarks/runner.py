"""Benchmarks the worker's model runner in-process (no NATS): decode step time and prefill speed.

For each dtype: the decode step time at each batch size (requests with --prompt-len random
tokens, prefilled first, then --decode-steps steps of one token each), the memory-bandwidth
bound of a batch-1 step (weight bytes / measured read bandwidth), prefill tokens/s at
--max-num-batched-tokens per step, and where a decode step's time goes (input preparation,
forward with attention broken out, sampling, output packing). Medians throughout.

--kernels cpp,torch runs everything twice in one invocation, with the C++ CPU kernels and with
the pure-torch fallback (LLM_MESH_CPU_KERNELS=0), and prints the torch/cpp step-time ratios;
--mixed-contexts 160x15,2100x1 adds a decode batch of unequal contexts (15 requests of 160
tokens and one of 2,100); --background busy|light runs a competing process during the
measurements (busy: one core kept at 100%; light: ~1 ms of CPU every 10 ms, like the mesh's
other services). --tensor-parallel-sizes 1,2 runs the model on one rank and split over two
(each rank on its share of the cores) and prints the TP=2/TP=1 step-time ratios.
--profile-batch N adds the torch profiler's table of where N requests' decode steps spend
their time.

    .venv/bin/python -m benchmarks.runner --dtypes float32,bfloat16 --batch-sizes 1,8,32,64
    .venv/bin/python -m benchmarks.runner --kernels cpp,torch --mixed-contexts 160x15,2100x1
    .venv/bin/python -m benchmarks.runner --weights dense --tensor-parallel-sizes 1,2
    .venv/bin/python -m benchmarks.runner --dtypes bfloat16 --batch-sizes 32 --profile-batch 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch
from torch.autograd import DeviceType

from benchmarks.harness import print_preamble
from kernels import cpu_ops
from services.common import wire_pb
from services.common.model_files import ModelFiles, resolve_model
from services.common.packing import pack_int32
from services.worker.runner.model_loader import resolve_device
from services.worker.runner.model_runner import ModelRunner, RunnerConfig

# A competing process for --background: `busy` spins one core; `light` spins ~1 ms every 10 ms.
BACKGROUND_CODE = {
    "busy": "while True: pass",
    "light": ("import time\nwhile True:\n    t = time.perf_counter()\n"
              "    while time.perf_counter() - t < 0.001: pass\n    time.sleep(0.009)"),
}


@dataclass
class Driver:
    """A minimal scheduler: fixed-size requests, blocks handed out sequentially."""

    runner: ModelRunner
    prompt_len: int
    max_new_tokens: int
    step: int = 0
    next_block: int = 1
    num_computed: dict[int, int] = field(default_factory=dict)

    def add_and_prefill(self, handles: list[int], budget: int,
                        prompt_lens: list[int] | None = None) -> list[float]:
        """Prefills the requests under the token budget; returns each step's seconds."""
        rng = np.random.default_rng(0)
        vocab = self.runner.info.vocab_size
        bs = self.runner.block_size
        lens = dict(zip(handles, prompt_lens or [self.prompt_len] * len(handles)))
        pending = []
        for h in handles:
            tokens = rng.integers(100, vocab - 100, lens[h])
            blocks_per_req = -(-(lens[h] + self.max_new_tokens + 1) // bs)
            blocks = range(self.next_block, self.next_block + blocks_per_req)
            self.next_block += blocks_per_req
            pending.append(new_request(h, tokens, blocks))
        times, started = [], []
        while pending or any(self.num_computed[h] < lens[h] for h in started):
            new, new_sched, cached, cached_sched, left = [], [], [], [], budget
            for h in started:
                todo = min(lens[h] - self.num_computed[h], left)
                if todo > 0:
                    cached.append(h)
                    cached_sched.append(todo)
                    left -= todo
            while pending and left > 0:
                req = pending.pop(0)
                new.append(req)
                new_sched.append(min(lens[req.handle], left))
                self.num_computed[req.handle] = 0
                started.append(req.handle)
                left -= new_sched[-1]
            sched = new_sched + cached_sched
            out = self._run(new, cached, sched)
            times.append(out.execute_s)
        return times

    def decode(self, handles: list[int]) -> wire_pb.StepOutput:
        return self._run([], handles, [1] * len(handles))

    def run_with_new(self, request: wire_pb.NewRequestData, num_tokens: int,
                     cached: list[int]) -> wire_pb.StepOutput:
        """One step: `request`'s first num_tokens prompt tokens beside a token of each of
        `cached` (decoding)."""
        self.num_computed[request.handle] = 0
        return self._run([request], cached, [num_tokens] + [1] * len(cached))

    def release(self, handles: list[int]) -> None:
        """Ends the requests; their blocks stay the caller's to hand out again."""
        self.runner.execute(wire_pb.StepInput(step=self.step,
                                              finished_handles=pack_int32(handles)))
        self.step += 1
        for h in handles:
            del self.num_computed[h]

    def finish(self, handles: list[int]) -> None:
        self.release(handles)
        self.next_block = 1

    def _run(self, new: list[wire_pb.NewRequestData], cached: list[int],
             sched: list[int]) -> wire_pb.StepOutput:
        step = wire_pb.StepInput(
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


def new_request(handle: int, tokens: Sequence[int],
                blocks: Sequence[int]) -> wire_pb.NewRequestData:
    """A greedy request of these prompt tokens on these KV blocks, never stopping at EOS."""
    return wire_pb.NewRequestData(
        handle=handle, request_id=str(handle), token_ids=pack_int32(tokens),
        num_prompt_tokens=len(tokens), block_ids=pack_int32(blocks),
        sampling=wire_pb.SamplingParams(ignore_eos=True))


class StepPhases:
    """Where the last step's time went, timed from outside the runner (it keeps no timers).

    The phases are split at calls of the runner: prepare (diffs applied, inputs built) runs
    from the step's start to `_forward`, forward to the return of `model.compute_logits`,
    sample to the sampler's return, output (tokens appended, StepOutput packed) to the step's
    end. Attention is the time inside the attention backend's forward, part of forward. On
    CUDA each phase mark synchronizes first, so a phase holds its kernels' time; attention's
    marks do not (a sync per layer would slow the step being measured).
    """

    PHASES = ("prepare", "forward", "attention", "sample", "output")

    def __init__(self, runner: ModelRunner):
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self._marks: dict[str, float] = {}
        self._sync = torch.cuda.synchronize if runner.device.type == "cuda" else None
        # NOTE: wrapping is the instrument: each instance attribute shadows its method for
        # this runner only; nothing else in the process is touched.
        runner._execute = self._timed(runner._execute, "start", "end")
        runner._forward = self._timed(runner._forward, "prepare", None)
        runner.model.compute_logits = self._timed(runner.model.compute_logits, None, "forward")
        runner.sampler = self._timed(runner.sampler, None, "sample")
        runner.attn_backend.forward = self._timed(runner.attn_backend.forward,
                                                  "attention_start", "attention_end")

    def _timed(self, fn: Callable[..., Any], before: str | None,
               after: str | None) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                self._mark(before)
            out = fn(*args, **kwargs)
            if after is not None:
                self._mark(after)
            return out

        return timed

    def _mark(self, name: str) -> None:
        if self._sync is not None and not name.startswith("attention"):
            self._sync()
        if name == "start":  # the seconds are always the last step's
            self.seconds = dict.fromkeys(self.PHASES, 0.0)
            self._marks.clear()
        now = self._marks[name] = time.perf_counter()
        m = self._marks
        if name == "attention_end":
            self.seconds["attention"] += now - m["attention_start"]
        elif name == "end" and "sample" in m:   # an idle step has no phases
            self.seconds.update(prepare=m["prepare"] - m["start"],
                                forward=m["forward"] - m["prepare"],
                                sample=m["sample"] - m["forward"], output=now - m["sample"])


def read_bandwidth_gbs(device: torch.device) -> float:
    """The read bandwidth (GB/s) of the memory the model runs from (RAM, or the GPU's): the
    best of a 512 MiB sum and a 256 MiB matrix-vector product (the read pattern of a batch-1
    decode), median of 5 each."""
    x = torch.ones(128 * 2**20, dtype=torch.float32, device=device)
    weight, vector = x[:64 * 2**20].view(-1, 1024), torch.ones(1, 1024, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None

    def gbs(fn, num_bytes: int) -> float:
        times = []
        for _ in range(6):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return num_bytes / statistics.median(times[1:]) / 1e9

    return max(gbs(x.sum, x.numel() * 4),
               gbs(lambda: torch.nn.functional.linear(vector, weight), weight.numel() * 4))


def bench_dtype(args: argparse.Namespace, files: ModelFiles, dtype: str, kernels: str,
                weights: str, bandwidth: float, tensor_parallel_size: int = 1) -> dict[str, float]:
    """Median decode step (ms) per batch label, with the C++ kernels or the torch fallback,
    with the GGUF's blocks for small fp32 batches or the dense weights only, on one rank or
    split over tensor-parallel ranks."""
    os.environ[cpu_ops.ENV_CPU_KERNELS] = "0" if kernels == "torch" else "1"
    started = time.perf_counter()
    longest = max([args.prompt_len] + [n for n, _ in args.mixed_contexts])
    runner = ModelRunner(RunnerConfig(
        model_dir=files.hf_dir, use_gguf_blocks=weights == "gguf", dtype=dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=longest + args.decode_steps + 64,
        kv_cache_memory=int(args.kv_cache_gib * 2**30),
        max_num_seqs=max(args.batch_sizes + [sum(c for _, c in args.mixed_contexts)]),
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend, num_threads=args.num_threads,
        tensor_parallel_size=tensor_parallel_size))
    try:
        return _bench_runner(args, runner, dtype, kernels, weights, bandwidth, started)
    finally:
        runner.close()


def _bench_runner(args: argparse.Namespace, runner: ModelRunner, dtype: str, kernels: str,
                  weights: str, bandwidth: float, started: float) -> dict[str, float]:
    kv_tokens = (runner.info.num_blocks - 1) * runner.info.block_size
    print(f"\n== {dtype}, {kernels} kernels, {weights} weights, "
          f"tensor parallel {runner.config.tensor_parallel_size} "
          f"({type(runner.attn_backend).__name__}; kv cache "
          f"{args.kv_cache_dtype}: {kv_tokens} tokens in {args.kv_cache_gib} GiB, "
          f"{runner.kv_spec.bytes_per_token} B/token; start-up "
          f"{time.perf_counter() - started:.1f} s, weights {runner.model.num_bytes / 1e6:.0f} MB, "
          f"read by a small batch {runner.model.small_batch_bytes / 1e6:.0f} MB)")
    phases = StepPhases(runner)
    driver = Driver(runner, args.prompt_len, args.decode_steps)
    bound_ms = runner.model.num_bytes / (bandwidth * 1e9) * 1e3
    read_bound_ms = runner.model.small_batch_bytes / (bandwidth * 1e9) * 1e3
    cases = [(f"batch {b:3d}", [args.prompt_len] * b) for b in args.batch_sizes]
    if args.mixed_contexts:
        label = "+".join(f"{c}x{n}" for n, c in args.mixed_contexts)
        cases.append((f"mixed {label}", [n for n, c in args.mixed_contexts for _ in range(c)]))
    step_ms = {}
    for label, prompt_lens in cases:
        if runner.device.type == "cuda":   # Triton compiles each new specialization once
            measure(args, driver, phases, prompt_lens)
        med, prefill_tps = measure(args, driver, phases, prompt_lens)
        step_ms[label] = med["step"]
        num = len(prompt_lens)
        line = (f"{label}: decode step {med['step']:6.1f} ms "
                f"({num / med['step'] * 1e3:6.0f} tok/s)  prefill {prefill_tps:6.0f} tok/s"
                f" | prepare {med['prepare']:.2f} forward {med['forward']:.1f} "
                f"(attention {med['attention']:.1f}) sample {med['sample']:.2f} "
                f"output {med['output']:.2f} ms")
        if num == 1:
            line += f" | bound {bound_ms:.1f} ms ({med['step'] / bound_ms:.2f}x)"
            if read_bound_ms < bound_ms:
                line += (f", of the bytes it reads {read_bound_ms:.1f} ms "
                         f"({med['step'] / read_bound_ms:.2f}x)")
        print(line, flush=True)
    if args.profile_batch:
        profile_decode(args, driver, args.profile_batch)
    return step_ms


def profile_decode(args: argparse.Namespace, driver: Driver, batch_size: int) -> None:
    """The torch profiler over --decode-steps decode steps at one batch size: the ops (on
    CUDA the kernels) that took the most time, and how many kernels a step launches."""
    handles = list(range(batch_size))
    driver.add_and_prefill(handles, args.max_num_batched_tokens, [args.prompt_len] * batch_size)
    driver.decode(handles)   # warm: the first step after prefill may compile or capture
    cuda = driver.runner.device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.decode_steps):
            driver.decode(handles)
        if cuda:
            torch.cuda.synchronize()
    driver.finish(handles)
    events = prof.key_averages()
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(f"\n-- profile: batch {batch_size}, {args.decode_steps} decode steps, by {sort_by}")
    print(events.table(sort_by=sort_by, row_limit=args.profile_rows, max_name_column_width=60))
    if cuda:
        kernels = sum(e.count for e in events if e.device_type == DeviceType.CUDA)
        print(f"-- kernels launched per decode step: {kernels / args.decode_steps:.0f}")


def print_ratio(dtype: str, what: str, names: list[str],
                results: list[dict[str, float]]) -> None:
    """Step time of the second configuration over the first's, per batch label."""
    base, other = results
    print(f"-- {dtype}: {what} {names[1]} / {names[0]} step time: " + ", ".join(
        f"{label.strip()} {other[label] / base[label]:.2f}x" for label in base))


def measure(args: argparse.Namespace, driver: Driver, phases: StepPhases,
            prompt_lens: list[int]) -> tuple[dict[str, float], float]:
    """Prefills the requests, then medians (ms) of --decode-steps decode steps' phases."""
    handles = list(range(len(prompt_lens)))
    prefill_times = driver.add_and_prefill(handles, args.max_num_batched_tokens, prompt_lens)
    samples: dict[str, list[float]] = {k: [] for k in ("step", *StepPhases.PHASES)}
    for _ in range(args.decode_steps):
        out = driver.decode(handles)
        samples["step"].append(out.execute_s)
        for k, v in phases.seconds.items():
            samples[k].append(v)
    driver.finish(handles)
    return ({k: statistics.median(v) * 1e3 for k, v in samples.items()},
            sum(prompt_lens) / sum(prefill_times))


def parse_contexts(spec: str) -> list[tuple[int, int]]:
    """'160x15,2100x1' -> [(160, 15), (2100, 1)]: (context tokens, number of requests)."""
    return [(int(n), int(c)) for n, c in (p.split("x") for p in spec.split(",") if p)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="HF dir or GGUF (default: SmolLM2-135M)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32,64",
                        type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--num-threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--kernels", default="cpp",
                        help="cpp (C++ CPU kernels), torch (the fallback), or both: cpp,torch")
    parser.add_argument("--weights", default="gguf",
                        help="gguf (small fp32 batches read a GGUF model's blocks, as the "
                             "worker does), dense, or both: gguf,dense")
    parser.add_argument("--tensor-parallel-sizes", default="1",
                        help="ranks to split the model over, or two to compare: 1,2")
    parser.add_argument("--mixed-contexts", default="", type=parse_contexts,
                        help="also a decode batch of unequal contexts, e.g. 160x15,2100x1")
    parser.add_argument("--background", default="none", choices=["none", *BACKGROUND_CODE],
                        help="a competing process during the run")
    parser.add_argument("--profile-batch", type=int, default=0,
                        help="also profile the decode steps at this batch size (torch "
                             "profiler: top ops, or kernels on CUDA)")
    parser.add_argument("--profile-rows", type=int, default=20)
    args = parser.parse_args(argv)
    print_preamble()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    files = resolve_model(args.model)
    torch.set_num_threads(args.num_threads or torch.get_num_threads())
    bandwidth = read_bandwidth_gbs(resolve_device(RunnerConfig.device))
    background = None
    if args.background != "none":
        background = subprocess.Popen([sys.executable, "-c", BACKGROUND_CODE[args.background]])
    try:
        print(f"read bandwidth {bandwidth:.1f} GB/s, {torch.get_num_threads()} threads, "
              f"background {args.background}, OMP_WAIT_POLICY="
              f"{os.environ.get('OMP_WAIT_POLICY', '-')} GOMP_SPINCOUNT="
              f"{os.environ.get('GOMP_SPINCOUNT', '-')}")
        kernels, weights = args.kernels.split(","), args.weights.split(",")
        sizes = [int(n) for n in args.tensor_parallel_sizes.split(",")]
        for dtype in args.dtypes.split(","):
            results = {(k, w, tp): bench_dtype(args, files, dtype, k, w, bandwidth, tp)
                       for k in kernels for w in weights for tp in sizes}
            k0, w0, tp0 = kernels[0], weights[0], sizes[0]
            if len(kernels) == 2:
                print_ratio(dtype, "kernels", kernels, [results[k, w0, tp0] for k in kernels])
            if len(weights) == 2:
                print_ratio(dtype, "weights", weights, [results[k0, w, tp0] for w in weights])
            if len(sizes) == 2:
                print_ratio(dtype, "tensor parallel", [f"TP={n}" for n in sizes],
                            [results[k0, w0, tp] for tp in sizes])
    finally:
        if background is not None:
            background.kill()


if __name__ == "__main__":
    main()
