"""What a prompt chunk costs beside running decodes: the worker's step in-process (no NATS).

--decodes requests are prefilled (--prompt-len tokens each) and decode; then each step also
carries one new request's first --chunks tokens (0: decodes alone), as a step under load
does. Prints the median step (ms) per chunk size and where it went: each linear, attention,
the layers' small ops, the LM head, the sampler, and the rest of the step (input
preparation, output packing, Python between the kernels). --compare-fused-mlp alternates
the MLP's fused gate_up + SiLU-and-mul (amx_linear_silu_mul, where the CPU has AMX) with
the two steps, in one process, and prints both medians.

    .venv/bin/python -m benchmarks.mixed_step --dtype bfloat16 --chunks 0,32,128
    .venv/bin/python -m benchmarks.mixed_step --dtype bfloat16 --chunks 0 --compare-fused-mlp
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog

from benchmarks.harness import print_preamble
from benchmarks.runner import Driver, new_request
from services.common.model_files import resolve_model
from services.worker.runner.model_runner import ModelRunner, RunnerConfig

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DECODE_ROOM = 512   # tokens each decoding request may still grow by: steps of a run


class OpTimes:
    """Seconds per op name, timed by wrapping the model's parts on this runner only (CPU
    ops are synchronous: a call's wall time is its op's)."""

    def __init__(self, runner: ModelRunner):
        self.seconds: dict[str, float] = defaultdict(float)
        model = runner.model
        for layer in model.layers:
            for name in LINEARS:
                self._time_linear(getattr(layer, name), name)
            self._wrap(layer, "act_and_mul", "act_and_mul")
        self._time_linear(model.lm_head, "lm_head")
        self._wrap(model.ops, "add_rms_norm", "add_rms_norm")
        for rotary in model.rotaries:
            self._wrap(rotary, "apply", "rope")
        self._wrap(runner.attn_backend, "forward", "attention")
        self._wrap(runner, "sampler", "sampler")
        self._wrap(runner, "_execute", "step")

    def _wrap(self, obj: Any, attr: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - started
            return out

        setattr(obj, attr, timed)

    def _time_linear(self, linear: Any, label: str) -> None:
        # NOTE: a subclass swapped in on this instance, so the model still sees the linear it
        # built (the fused MLP checks isinstance) and both entry points are timed.
        base, seconds = type(linear), self.seconds

        class Timed(base):  # type: ignore[valid-type, misc]
            def __call__(self, x: Any) -> Any:
                started = time.perf_counter()
                out = super().__call__(x)
                seconds[label] += time.perf_counter() - started
                return out

            def silu_and_mul(self, x: Any) -> Any:
                started = time.perf_counter()
                out = super().silu_and_mul(x)
                seconds[f"{label} + silu_and_mul"] += time.perf_counter() - started
                return out

        linear.__class__ = Timed


class MixedSteps:
    def __init__(self, runner: ModelRunner, decodes: int, prompt_len: int, max_chunk: int):
        self.runner = runner
        self.driver = Driver(runner, prompt_len, max_new_tokens=DECODE_ROOM)
        self.decodes = list(range(1, decodes + 1))
        self.driver.add_and_prefill(self.decodes, runner.config.max_num_batched_tokens)
        # Every chunk's request gets the same spare blocks and leaves after its step.
        self.spare = self.driver.next_block
        self.chunk_blocks = -(-(max_chunk + 1) // runner.block_size)
        self.next_handle = decodes + 1
        self.rng = np.random.default_rng(1)

    def step(self, chunk: int) -> float:
        """One step: the decodes, and a new request's first `chunk` tokens; its seconds."""
        d = self.driver
        if chunk == 0:
            return d.decode(self.decodes).execute_s
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        vocab = self.runner.info.vocab_size
        request = new_request(handle, self.rng.integers(100, vocab - 100, chunk + 1),
                              range(self.spare, self.spare + self.chunk_blocks))
        seconds = d.run_with_new(request, chunk, self.decodes).execute_s
        d.release([handle])
        return seconds


def set_fused_mlp(runner: ModelRunner, fused: bool) -> None:
    for layer in runner.model.layers:
        layer.silu_mlp = fused


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decodes", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--chunks", default="0,32,128",
                        type=lambda s: [int(x) for x in s.split(",") if x])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--compare-fused-mlp", action="store_true")
    args = parser.parse_args(argv)
    print_preamble()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    max_chunk = max(args.chunks)
    runner = ModelRunner(RunnerConfig(
        model_dir=resolve_model("").hf_dir, use_gguf_blocks=True, dtype=args.dtype,
        max_model_len=args.prompt_len + DECODE_ROOM + 1, kv_cache_memory=2 * 2**30,
        max_num_seqs=args.decodes + 2,
        max_num_batched_tokens=max(args.prompt_len, max_chunk, 128)))
    try:
        # NOTE: measured after the KV cache's pages are in (kv_prefault.py): a step that
        # first writes a page waits for the kernel.
        for thread in threading.enumerate():
            if thread.name == "kv-prefault":
                thread.join()
        steps = MixedSteps(runner, args.decodes, args.prompt_len, max_chunk)
        if args.compare_fused_mlp:
            compare_fused_mlp(steps, args)
        else:
            breakdown(steps, args)
    finally:
        runner.close()


def breakdown(steps: MixedSteps, args: argparse.Namespace) -> None:
    ops = OpTimes(steps.runner)
    for chunk in args.chunks:
        steps.step(chunk)   # warm
        ops.seconds.clear()
        times = [steps.step(chunk) for _ in range(args.repeats)]
        per_step = {k: v / args.repeats * 1e3 for k, v in ops.seconds.items()}
        total = per_step.pop("step")
        rest = total - sum(per_step.values())
        parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_step.items(),
                                                             key=lambda kv: -kv[1]))
        median_ms = statistics.median(times) * 1e3
        print(f"{args.decodes} decodes + a {chunk}-token chunk: step {median_ms:.2f} ms median"
              f" | mean {total:.2f} ms: {parts}, the rest {rest:.2f}", flush=True)


def compare_fused_mlp(steps: MixedSteps, args: argparse.Namespace) -> None:
    for chunk in args.chunks:
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.repeats):
            for fused in (True, False):
                set_fused_mlp(steps.runner, fused)
                times[fused] += [steps.step(chunk) for _ in range(4)]
        fused_ms, two_ms = (statistics.median(times[f]) * 1e3 for f in (True, False))
        print(f"{args.decodes} decodes + a {chunk}-token chunk: fused gate_up + SiLU-and-mul "
              f"{fused_ms:.2f} ms, two steps {two_ms:.2f} ms ({two_ms / fused_ms:.3f}x)",
              flush=True)


if __name__ == "__main__":
    main()
