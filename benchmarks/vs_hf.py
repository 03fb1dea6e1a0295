"""The mesh against HF transformers on one workload, in one run: HF `generate` in-process
(static batching, and with --continuous transformers' own continuous batching) at each batch
size, then `llm-mesh up` + `llm-mesh bench serve` at each concurrency, all in the same dtype,
then one table of output tokens/s and the mesh/HF ratios.

    python -m benchmarks.vs_hf --dtype float32 --sizes 1,8,16,32,64 --continuous

The `random` workload: --input-len random prompt tokens, --output-len generated tokens
(ignore_eos). Batch size N in HF is compared with concurrency N through the mesh
(4N prompts, so the mesh runs at steady state). HF static batching is skipped above
--max-hf-batch (its padded batch would not fit the budget of the run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import REPO_ROOT, markdown_table, print_preamble
from benchmarks.mesh import run_config
from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics


def hf_figures(dtype: str, sizes: list[int], input_len: int, output_len: int,
               continuous: bool) -> dict[tuple[str, int], float]:
    """{(engine, batch): output tok/s} from benchmarks.hf, run as its own process so its
    memory and threads are gone before the mesh starts."""
    command = [sys.executable, "-m", "benchmarks.hf", "--dtype", dtype,
               "--batch-sizes", ",".join(map(str, sizes)), "--input-len", str(input_len),
               "--output-len", str(output_len), *(["--continuous"] if continuous else [])]
    done = subprocess.run(command, check=True, cwd=REPO_ROOT, capture_output=True, text=True)
    figures = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            print(line, flush=True)
            figures[(row["engine"], row["batch"])] = row["output_tok_s"]
    return figures


def mesh_figures(dtype: str, up_args: list[str], sizes: list[int], input_len: int,
                 output_len: int, out_dir: Path) -> dict[int, BenchmarkMetrics]:
    """{concurrency: bench serve metrics} from one mesh serving every run in turn."""
    workload = ["--workload", "random", "--input-len", str(input_len), "--output-len",
                str(output_len), "--ignore-eos"]
    benches = [[*workload, "--max-concurrency", str(n), "--num-prompts", str(4 * n)]
               for n in sizes]
    benches[0] += ["--warmup", "1"]
    runs = run_config(f"mesh-{dtype}", ["--dtype", dtype, *up_args], benches, out_dir)
    return dict(zip(sizes, runs, strict=True))


def print_table(dtype: str, sizes: list[int], hf: dict[tuple[str, int], float],
                mesh: dict[int, BenchmarkMetrics]) -> None:
    engines = sorted({engine for engine, _ in hf})
    header = ["size", "mesh tok/s", "mesh TPOT P50 ms"]
    for engine in engines:
        header += [f"{engine} tok/s", f"mesh / {engine}"]
    rows = []
    for n in sizes:
        run = mesh[n]
        tpot = run.tpot.p50 if run.tpot else float("nan")  # ms
        row = [str(n), f"{run.output_throughput:.1f}", f"{tpot:.1f}"]
        for engine in engines:
            base = hf.get((engine, n))
            row += ([f"{base:.1f}", f"{run.output_throughput / base:.2f}x"] if base
                    else ["-", "-"])
        rows.append(row)
    print(f"\n{dtype}: output tokens/s (HF batch N vs mesh concurrency N)\n")
    print(markdown_table(header, rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--sizes", default="1,8,16,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--continuous", action="store_true",
                        help="also measure transformers' continuous batching")
    parser.add_argument("--max-hf-batch", type=int, default=32)
    parser.add_argument("--up-args", default="", help="more `llm-mesh up` flags")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "vs-hf")
    args = parser.parse_args(argv)
    print_preamble()
    sizes = [int(s) for s in args.sizes.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    hf = hf_figures(args.dtype, [s for s in sizes if s <= args.max_hf_batch], args.input_len,
                    args.output_len, args.continuous)
    mesh = mesh_figures(args.dtype, args.up_args.split(), sizes, args.input_len,
                        args.output_len, args.out)
    print_table(args.dtype, sizes, hf, mesh)


if __name__ == "__main__":
    main()
