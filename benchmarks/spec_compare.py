"""Speculative methods against no speculation in the mesh's model runner, in-process (no NATS
or HTTP): tok/s, acceptance length and whether greedy text stays the same, at concurrency 1
and 8 (benchmarks/train_eagle3.py, benchmarks/mtp_checkpoint.py).

Methods are interleaved prompt group by prompt group, so every method meets the same machine
load; with `repeats` the whole run is repeated on fresh runners (suffix decoding would
otherwise draft from the first round's outputs) and each group's fastest round counts, which
keeps other tenants' bursts out of the figures. Each concurrency starts on fresh runners too.
Acceptance length is vLLM's: 1 + accepted drafts per step that verified drafts.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from services.common.speculative_config import SpeculativeConfig


def serve(runner, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """The prompts served together (greedy, to EOS or max_new_tokens): outputs, seconds, and
    the speculation counts (requests' steps that verified drafts, draft tokens, accepted)."""
    from tests.worker.driver import StepDriver
    driver = StepDriver(runner)
    handles = [driver.add(p, max_new_tokens) for p in prompts]
    requests = [driver.requests[h] for h in handles]
    num_verifying = 0
    started = time.perf_counter()
    while any(not r.done for r in requests):
        before = [r.num_verified for r in requests]
        driver.run_step()
        num_verifying += sum(r.num_verified > b for r, b in zip(requests, before, strict=True))
    seconds = time.perf_counter() - started
    driver.run_step()   # sends the finished handles
    return {"outputs": [r.output_ids for r in requests], "seconds": seconds,
            "verifying": num_verifying, "drafted": sum(r.num_verified for r in requests),
            "accepted": sum(r.num_accepted for r in requests)}


def serve_all(model_dir: Path, methods: dict[str, SpeculativeConfig | None],
              groups: list[list[list[int]]], max_new_tokens: int) -> list[dict[str, dict]]:
    """Every group served by every method (fresh runners: nothing cached from an earlier
    round), methods interleaved group by group: per group, each method's `serve`."""
    from services.worker.runner.model_runner import ModelRunner, RunnerConfig
    runners = {name: ModelRunner(RunnerConfig(model_dir=model_dir, max_num_seqs=8,
                                              max_model_len=1024, kv_cache_memory=2**28,
                                              speculative_config=spec))
               for name, spec in methods.items()}
    for runner in runners.values():   # warm-up: first-touch page faults, kernel caches
        serve(runner, groups[-1][-1:], 8)
    served = [{name: serve(runner, group, max_new_tokens) for name, runner in runners.items()}
              for group in groups]
    for runner in runners.values():
        runner.close()
    return served


def compare(model_dir: Path, methods: dict[str, SpeculativeConfig | None],
            prompts: list[list[int]], num_prompts: int, max_new_tokens: int,
            seed: int = 0, repeats: int = 1) -> None:
    """Prints one JSON line per concurrency (1: num_prompts prompts, 8: twice as many) and
    method; the first method is the baseline (no speculation). With repeats, every group's
    fastest round counts."""
    prompts = random.Random(seed).sample(prompts, len(prompts))   # topics mixed
    for concurrency, count in ((1, num_prompts), (8, 2 * num_prompts)):
        groups = [prompts[start:min(start + concurrency, count)]
                  for start in range(0, count, concurrency)]
        rounds = [serve_all(model_dir, methods, groups, max_new_tokens)
                  for _ in range(repeats)]
        totals = {name: {"tokens": 0, "seconds": 0.0, "verifying": 0, "drafted": 0,
                         "accepted": 0, "identical": True} for name in methods}
        for i in range(len(groups)):
            plain = rounds[0][i][next(iter(methods))]["outputs"]
            for name, total in totals.items():
                fastest = min((r[i][name] for r in rounds), key=lambda s: s["seconds"])
                total["tokens"] += sum(map(len, fastest["outputs"]))
                total["identical"] &= all(r[i][name]["outputs"] == plain for r in rounds)
                for key in ("seconds", "verifying", "drafted", "accepted"):
                    total[key] += fastest[key]
        base = next(iter(totals.values()))
        base_tok_s = base["tokens"] / base["seconds"]
        for name, total in totals.items():
            tok_s = total["tokens"] / total["seconds"]
            verifying = max(total["verifying"], 1)
            print(json.dumps({
                "concurrency": concurrency, "method": name, "prompts": count,
                "output_tokens": total["tokens"], "tok_s": round(tok_s, 1),
                "speed_up": round(tok_s / base_tok_s, 2),
                "acceptance_length": round(1 + total["accepted"] / verifying, 2),
                "draft_tokens_accepted": round(total["accepted"] / max(total["drafted"], 1), 2),
                "same_greedy_text_as_none": total["identical"]}), flush=True)
