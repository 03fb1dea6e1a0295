"""Benchmarks the whole mesh the way users run it: `llm-mesh up` with the given flags, then
`llm-mesh bench serve` against it, then a clean stop. Several configurations run one after
the other in one invocation, so a comparison is measured in one run on one machine.

    python -m benchmarks.mesh \
        --config "fp32=--dtype float32" --config "bf16=--dtype bfloat16" \
        --bench "--workload random --input-len 128 --output-len 128 --ignore-eos \
                 --max-concurrency 8 --num-prompts 16"

Each --bench runs in turn against each configuration's mesh. Prints the bench reports, the
step messaging of each bench (the worker call's time beyond the worker's own: the step
transport, local channel or NATS, and serialization; from the schedulers' metrics), its
speculative decoding's acceptance length where drafts were verified, and the
CPU seconds each process spent during each bench, in all and per 1,000 generated tokens (the
services' per-token work: on two cores, time the worker's threads do not get), and writes JSON results and every
service's /metrics under --out.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cpu_accounting import CpuUse, cpu_use
from benchmarks.harness import (
    REPO_ROOT,
    RunningMesh,
    bench_serve,
    mesh_up,
    metrics_url,
    print_preamble,
    scrape,
    service_health_urls,
    sum_of,
)
from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics


def scrape_services(mesh: RunningMesh, label: str, out_dir: Path) -> None:
    """Saves the gateway's and each service's own /metrics."""
    (out_dir / f"{label}.gateway-metrics.txt").write_text(scrape(f"{mesh.url}/metrics"))
    for service, health in service_health_urls(mesh.log).items():
        (out_dir / f"{label}.{service}-metrics.txt").write_text(scrape(metrics_url(health)))


HOPS = ("to_worker", "worker", "back", "to_loop")


@dataclass(frozen=True)
class StepTotals:
    """Every engine's scheduler's step histograms so far: counts and sums in seconds."""
    steps: float
    step: float
    execute: float                    # the worker's own time in them
    messaging: float
    hop_steps: float                  # steps that went over the local channel
    hops: tuple[float, ...]           # the sum of each of HOPS
    spec: tuple[float, ...]           # speculative decoding: each of SPEC_COUNTERS

    def __sub__(self, before: StepTotals) -> StepTotals:
        return StepTotals(self.steps - before.steps, self.step - before.step,
                          self.execute - before.execute, self.messaging - before.messaging,
                          self.hop_steps - before.hop_steps,
                          tuple(a - b for a, b in zip(self.hops, before.hops, strict=True)),
                          tuple(a - b for a, b in zip(self.spec, before.spec, strict=True)))


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def step_totals(mesh: RunningMesh) -> StepTotals:
    totals = StepTotals(0.0, 0.0, 0.0, 0.0, 0.0, (0.0,) * len(HOPS), (0.0,) * len(SPEC_COUNTERS))
    for service, health in service_health_urls(mesh.log).items():
        if service.split(".")[0] == "scheduler":
            text = scrape(metrics_url(health))
            hop = "llm_mesh:step_hop_seconds"
            totals = StepTotals(
                totals.steps + sum_of(text, "llm_mesh:engine_step_seconds_count"),
                totals.step + sum_of(text, "llm_mesh:engine_step_seconds_sum"),
                totals.execute + sum_of(text, "llm_mesh:worker_execute_seconds_sum"),
                totals.messaging + sum_of(text, "llm_mesh:step_messaging_seconds_sum"),
                totals.hop_steps + sum_of(text, f"{hop}_count", 'hop="back"'),
                tuple(total + sum_of(text, f"{hop}_sum", f'hop="{name}"')
                      for total, name in zip(totals.hops, HOPS, strict=True)),
                tuple(total + sum_of(text, f"vllm:spec_decode_{name}_total")
                      for total, name in zip(totals.spec, SPEC_COUNTERS, strict=True)))
    return totals


def acceptance(during: StepTotals) -> str:
    """vLLM's mean acceptance length (tokens a verifying step emits: 1 + accepted drafts)
    and the share of draft tokens accepted; empty without speculation."""
    num_drafts, num_draft_tokens, num_accepted = during.spec
    if not num_drafts:
        return ""
    return (f"; speculative decoding: acceptance length {1 + num_accepted / num_drafts:.2f}, "
            f"{100 * num_accepted / num_draft_tokens:.0f}% of {num_draft_tokens:.0f} draft "
            f"tokens accepted")


def step_overhead(during: StepTotals) -> str:
    """The step messaging of a bench, and hop by hop where its steps took the local channel."""
    if not during.steps:
        return "no steps"
    report = (f"{during.steps:.0f} steps, step {1e3 * during.step / during.steps:.2f} ms mean "
              f"(the worker's execute {1e3 * during.execute / during.steps:.2f}), step "
              f"messaging (transport + serialization) "
              f"{1e3 * during.messaging / during.steps:.3f} ms mean = "
              f"{100 * during.messaging / during.step:.1f}% of step time")
    if during.hop_steps:
        report += "; hops (ms mean): " + ", ".join(
            f"{name} {1e3 * total / during.hop_steps:.3f}"
            for name, total in zip(HOPS, during.hops, strict=True))
    return report


def cpu_per_kilotoken(use: CpuUse, num_tokens: int) -> str:
    """Each process's CPU seconds per 1,000 of the bench's generated tokens."""
    if not num_tokens:
        return "no tokens"
    return "CPU seconds per 1,000 tokens: " + ", ".join(
        f"{label} {1e3 * seconds / num_tokens:.3f}"
        for label, seconds in sorted(use.by_process.items(), key=lambda kv: -kv[1]))


def run_config(label: str, up_args: Sequence[str], benches: Sequence[Sequence[str]],
               out_dir: Path) -> list[BenchmarkMetrics]:
    """One mesh with `up_args`, every bench against it in turn; their metrics (results
    under `out_dir` as `{label}.{index}.json`)."""
    with mesh_up(up_args, out_dir / f"{label}.mesh.log") as mesh:
        print(f"\n### {label}: llm-mesh up {' '.join(up_args)}", flush=True)
        results = []
        for index, bench_args in enumerate(benches):
            before = step_totals(mesh)
            with cpu_use(mesh.pid) as use:
                results.append(bench_serve(mesh.url, out_dir / f"{label}.{index}.json",
                                           bench_args))
            print(f"{label} bench {index}: {use.report()}", flush=True)
            print(f"{label} bench {index}: "
                  f"{cpu_per_kilotoken(use, results[-1].total_output_tokens)}", flush=True)
            during = step_totals(mesh) - before
            print(f"{label} bench {index} steps: {step_overhead(during)}{acceptance(during)}",
                  flush=True)
        scrape_services(mesh, label, out_dir)
    return results


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True,
                        help='"label=<llm-mesh up flags>"; repeat to compare')
    parser.add_argument("--bench", action="append", required=True,
                        help="llm-mesh bench serve flags; repeat to run several in turn")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results")
    args = parser.parse_args(argv)
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    for config in args.config:
        label, _, flags = config.partition("=")
        run_config(label, shlex.split(flags), [shlex.split(b) for b in args.bench], args.out)


if __name__ == "__main__":
    main()
