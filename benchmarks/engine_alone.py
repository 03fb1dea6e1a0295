"""The engine without the mesh: the scheduler's core and the worker's model runner in one
process, with nothing between the steps — no NATS hops, no gateway, tokenizer or client
sharing the cores. It drives `llm-mesh bench serve`'s random workload shape closed-loop
(`--concurrency` requests in flight, prompts of `--input-len` random token ids, `--output-len`
greedy tokens with ignore_eos, a new request as each one ends) with the settings
`llm-mesh up --dtype D` gives both services, and prints output tok/s, TTFT, TPOT and ITL as
the bench defines them, and the steps' time.

What it is for: the mesh's figures against these say what the services and their messages
cost a step on the same machine; these against another engine's say how far the engine's own
steps and scheduling policy could take it there (docs/benchmarks.md section 10o).

Run: .venv/bin/python -m benchmarks.engine_alone --dtype bfloat16 --concurrency 8,32
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from benchmarks.harness import distribution, markdown_table, print_preamble
from services.common import wire, wire_pb
from services.common.model_files import resolve_model
from services.scheduler.core import Request, Scheduler
from services.scheduler.settings import SchedulerSettings
from services.scheduler.step_codec import decode_step_output, encode_step_input
from services.worker.runner.model_runner import ModelRunner, RunnerConfig
from services.worker.runner.warm_up import warm_up
from services.worker.settings import WorkerSettings


@dataclass
class _Timeline:
    arrival: float
    token_times: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    concurrency: int
    duration_s: float
    output_tokens: int
    steps: int
    execute_s: float
    timelines: list[_Timeline]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s


class EngineAlone:
    """One scheduler core and one model runner, stepped in turn on this thread."""

    def __init__(self, dtype: str, kv_cache_memory: int = 0) -> None:
        """`kv_cache_memory`: the KV cache's bytes (0: the worker's own sizing)."""
        files = resolve_model(None)
        worker_settings = WorkerSettings(dtype=dtype, kv_cache_memory=kv_cache_memory)
        self.runner = ModelRunner(RunnerConfig.from_settings(worker_settings, files.hf_dir))
        warm_up(self.runner)   # as the worker service does before it says hello
        # NOTE: as the mesh's runs start after its KV cache's pages are in (section 10's
        # benches start 45 s after /health): a first write into a fresh page stalls a step.
        for thread in threading.enumerate():
            if thread.name == "kv-prefault":
                thread.join()
        info = self.runner.info
        self.info = info
        self.scheduler_config = SchedulerSettings().scheduler_config(wire.WorkerInfo(
            num_blocks=info.num_blocks, block_size=info.block_size,
            max_model_len=info.max_model_len, vocab_size=info.vocab_size))
        self._next_id = 0

    def close(self) -> None:
        self.runner.close()

    def run(self, concurrency: int, num_prompts: int, input_len: int, output_len: int,
            rng: random.Random) -> RunResult:
        """`num_prompts` requests, `concurrency` at a time, on a fresh scheduler (the worker's
        rows reset with its first step, as after a scheduler restart)."""
        scheduler = Scheduler(self.scheduler_config)
        timelines: dict[str, _Timeline] = {}
        submitted = steps = output_tokens = 0
        execute_s = 0.0
        reset = True

        def submit() -> None:
            nonlocal submitted
            request_id = f"r{self._next_id}"
            self._next_id += 1
            prompt = [rng.randrange(100, self.info.vocab_size - 100) for _ in range(input_len)]
            sampling = wire_pb.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=output_len,
                                              ignore_eos=True, repetition_penalty=1.0)
            scheduler.add_request(Request(
                request_id, prompt, max_tokens=output_len, ignore_eos=True,
                eos_token_ids=self.info.eos_token_ids, arrival_time=scheduler.clock(),
                sampling=sampling, block_hasher=scheduler.block_hasher))
            timelines[request_id] = _Timeline(time.perf_counter())
            submitted += 1

        started = time.perf_counter()
        for _ in range(min(concurrency, num_prompts)):
            submit()
        while scheduler.has_unfinished_requests():
            scheduler_output = scheduler.schedule()
            step_output = self.runner.execute(encode_step_input(scheduler_output, reset=reset))
            reset = False
            if step_output.error:
                raise RuntimeError(f"step {scheduler_output.step} failed: {step_output.error}")
            now = time.perf_counter()
            steps += 1
            execute_s += step_output.execute_s
            outputs = scheduler.update_from_output(scheduler_output,
                                                   decode_step_output(step_output))
            scheduler.observe_step(scheduler_output, step_output.execute_s)
            for out in outputs:
                if out.new_token_ids:
                    timelines[out.request_id].token_times.append(now)
                    output_tokens += len(out.new_token_ids)
                if out.finished and submitted < num_prompts:
                    submit()
        return RunResult(concurrency, time.perf_counter() - started, output_tokens, steps,
                         execute_s, list(timelines.values()))


def summarize(result: RunResult) -> list[str]:
    ttft = [t.token_times[0] - t.arrival for t in result.timelines]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
            for t in result.timelines if len(t.token_times) > 1]
    itl = [b - a for t in result.timelines for a, b in zip(t.token_times, t.token_times[1:])]
    d_ttft, d_tpot, d_itl = distribution(ttft), distribution(tpot), distribution(itl)
    return [str(result.concurrency), f"{result.output_throughput:.1f}",
            f"{d_ttft.p50:.0f} / {d_ttft.p99:.0f}", f"{d_tpot.p50:.1f}",
            f"{d_itl.p50:.1f} / {d_itl.p99:.1f}", str(result.steps),
            f"{result.execute_s / result.steps * 1e3:.1f}",
            f"{(result.duration_s - result.execute_s) / result.steps * 1e3:.2f}"]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="comma-separated requests in flight, one run each")
    parser.add_argument("--prompts-per-slot", type=int, default=4,
                        help="requests per run: this times the concurrency (the bench's "
                             "--num-prompts in section 10 is 4 x concurrency)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    print_preamble()
    engine = EngineAlone(args.dtype)
    rng = random.Random(args.seed)
    rows = []
    try:
        engine.run(1, 1, args.input_len, args.output_len, rng)   # warm-up, as the bench's
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            result = engine.run(concurrency, args.prompts_per_slot * concurrency,
                                args.input_len, args.output_len, rng)
            rows.append(summarize(result))
            print(f"concurrency {concurrency}: {result.output_throughput:.1f} tok/s", flush=True)
    finally:
        engine.close()
    print(f"\n{args.dtype}, random {args.input_len} in / {args.output_len} out, ignore_eos, "
          f"greedy; budget {engine.scheduler_config.max_num_batched_tokens} tokens a step\n")
    print(markdown_table(["conc.", "tok/s", "TTFT P50 / P99 (ms)", "TPOT P50 (ms)",
                          "ITL P50 / P99 (ms)", "steps", "execute ms a step",
                          "between steps ms"], rows))


if __name__ == "__main__":
    main()
