"""Prompts run alone and mixed into batches, through StepDriver: what the batch-invariance
test and benchmark (benchmarks/batch_invariance.py) compare. Greedy, with the logprob of each
sampled token; a step budget smaller than the prompts chunks their prefill."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from services.common import wire
from services.worker.runner.model_runner import ModelRunner
from tests.worker.driver import StepDriver

Outputs = dict[int, tuple[list[int], list[float]]]   # prompt index -> its tokens, logprobs


def random_prompts(num: int, vocab_size: int, min_len: int, max_len: int,
                   seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab_size - 100, int(n)).tolist()
            for n in rng.integers(min_len, max_len + 1, num)]


@dataclass
class BatchRun:
    outputs: Outputs
    num_tokens: int
    seconds: float


def run_together(runner: ModelRunner, prompts: dict[int, list[int]], max_new_tokens: int,
                 token_budget: int) -> BatchRun:
    """The prompts as one batch, in the dict's order, under a per-step token budget."""
    driver = StepDriver(runner, token_budget=token_budget)
    sampling = wire.SamplingParams(temperature=0.0, logprobs=0)
    handles = {index: driver.add(ids, max_new_tokens, sampling, stop_at_eos=False)
               for index, ids in prompts.items()}
    started = time.perf_counter()
    tokens = driver.run()
    seconds = time.perf_counter() - started
    outputs = {index: (tokens[h], [lp for _, lp, _, _ in driver.requests[h].logprobs])
               for index, h in handles.items()}
    return BatchRun(outputs, sum(len(t) for t, _ in outputs.values()), seconds)


def run_alone(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
              token_budget: int) -> BatchRun:
    runs = [run_together(runner, {i: ids}, max_new_tokens, token_budget)
            for i, ids in enumerate(prompts)]
    return BatchRun({i: out for run in runs for i, out in run.outputs.items()},
                    sum(run.num_tokens for run in runs), sum(run.seconds for run in runs))


def run_mixed(runner: ModelRunner, prompts: list[list[int]], batch_sizes: list[int],
              max_new_tokens: int, token_budget: int, seed: int = 0) -> BatchRun:
    """The prompts shuffled, then cut into batches of `batch_sizes` (which sum to their
    number), each run as one batch: other batchmates, positions and chunk boundaries."""
    assert sum(batch_sizes) == len(prompts)
    order = np.random.default_rng(seed).permutation(len(prompts)).tolist()
    runs, start = [], 0
    for size in batch_sizes:
        batch = {i: prompts[i] for i in order[start:start + size]}
        runs.append(run_together(runner, batch, max_new_tokens, token_budget))
        start += size
    return BatchRun({i: out for run in runs for i, out in run.outputs.items()},
                    sum(run.num_tokens for run in runs), sum(run.seconds for run in runs))


def num_differing(a: Outputs, b: Outputs) -> tuple[int, int]:
    """(prompts whose tokens differ, prompts whose logprobs differ bit for bit)."""
    tokens = sum(a[i][0] != b[i][0] for i in a)
    logprobs = sum(np.asarray(a[i][1], np.float32).tobytes()
                   != np.asarray(b[i][1], np.float32).tobytes() for i in a)
    return int(tokens), int(logprobs)
