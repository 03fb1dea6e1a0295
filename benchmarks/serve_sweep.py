"""One model under `llm-mesh bench serve` at each concurrency, served by the mesh (`llm-mesh
up`) or by vLLM's OpenAI-compatible server: the serving stages of scripts/gpu_check.sh.

    python -m benchmarks.serve_sweep --server mesh --model /tmp/llama3-8b \
        --concurrency 1,8,32,128 --server-args "--device cuda --dtype bfloat16" --out OUT

Each concurrency n runs the random workload (--input-len / --output-len with ignore_eos,
4 n prompts, one warm-up request: benchmarks/other_server.py's points; prompts made with the
model directory's own tokenizer, so the embedded model need not be there), then one line per
point (TTFT P50, TPOT P50, output tok/s, failures) and a table close the run. Exits 1 when a
request failed or none completed, so the calling stage can say FAIL.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import bench_serve, markdown_table, print_preamble, serving
from benchmarks.mesh import run_config
from benchmarks.other_server import bench_args
from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics
from llm_mesh.embedded import free_port


def run_vllm(model: Path, name: str, server_args: Sequence[str],
             benches: Sequence[Sequence[str]], out: Path) -> list[BenchmarkMetrics]:
    """vLLM's OpenAI server on `model`, every bench against it in turn."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
               str(model), "--served-model-name", name, "--host", "127.0.0.1", "--port",
               str(port), *server_args]
    with serving(command, url, out / f"{name}.vllm.log", env={"HF_HUB_OFFLINE": "1"}):
        print(f"\n### vllm: {shlex.join(command)}", flush=True)
        return [bench_serve(url, out / f"{name}.vllm.{index}.json", args, model=name)
                for index, args in enumerate(benches)]


def figures(m: BenchmarkMetrics) -> list[str]:
    """TTFT P50 (ms), TPOT P50 (ms), output tok/s."""
    return [f"{m.ttft.p50:.1f}" if m.ttft else "-", f"{m.tpot.p50:.2f}" if m.tpot else "-",
            f"{m.output_throughput:.1f}"]


def point_line(label: str, n: int, m: BenchmarkMetrics) -> str:
    ttft, tpot, throughput = figures(m)
    return (f"{label} c={n}: TTFT P50 {ttft} ms, TPOT P50 {tpot} ms, {throughput} output "
            f"tok/s, {m.completed} done, {m.failed} failed")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("mesh", "vllm"), default="mesh")
    parser.add_argument("--model", type=Path, required=True, help="an HF model directory")
    parser.add_argument("--server-args", default="",
                        help="extra flags of `llm-mesh up` or of vLLM's server")
    parser.add_argument("--concurrency", default="1,8,32,128")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    # A stage's timeout sends SIGTERM: unwind, so `serving` stops the server it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(c) for c in args.concurrency.split(",")]
    # Both servers honour vLLM's ignore_eos: every request makes --output-len tokens.
    benches = [[*bench_args("vllm", n, args.input_len, args.output_len),
                "--tokenizer", str(args.model)] for n in sizes]
    name = args.model.name
    label = f"{args.server} {name}"
    extra = shlex.split(args.server_args)
    if args.server == "mesh":
        results = run_config(name, ["--model", str(args.model), *extra], benches, args.out)
    else:
        results = run_vllm(args.model, name, extra, benches, args.out)
    print()
    for n, m in zip(sizes, results, strict=True):
        print(point_line(label, n, m), flush=True)
    print("\n" + markdown_table(
        ["concurrency", "TTFT P50 (ms)", "TPOT P50 (ms)", "output tok/s", "failed"],
        [[n, *figures(m), m.failed] for n, m in zip(sizes, results)]))
    return 0 if all(m.failed == 0 and m.completed for m in results) else 1


if __name__ == "__main__":
    sys.exit(main())
