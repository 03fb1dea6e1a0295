"""`llm-mesh bench serve` against a second OpenAI-compatible server on the same model and
workload: vLLM's CPU build (the prime peer, installed beside the project by
../shared/anchors/setup_vllm_cpu.sh), `transformers serve` (transformers' own server, with its
continuous batching and paged attention) or llama.cpp's `llama-server` on the embedded GGUF,
where one is installed.

    python -m benchmarks.other_server --server vllm --dtype bfloat16 \
        --concurrency 1,8,32 --mesh-only-concurrency 64 --out bench-results/vllm

Then `llm-mesh up` serves the same runs (benchmarks/mesh.py), and a table of the two
with their ratio closes the run. The server runs in its own process on a random loopback
port; each concurrency runs the `random` workload (128/128, 4 x concurrency prompts, one
warm-up request) on prompts of its own (a seed per point, the same for both servers, so no
point hits a prefix cached by an earlier one) and each report and JSON lands under --out. `transformers serve` refuses
vLLM's `ignore_eos` (HTTP 422), so its requests may end at EOS before 128 tokens: the
report counts the tokens actually generated.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import REPO_ROOT, bench_serve, markdown_table, print_preamble, serving
from benchmarks.mesh import run_config
from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics, Distribution
from llm_mesh.bench.plot import write_plot
from llm_mesh.embedded import free_port
from services.common.model_files import embedded_gguf_path, resolve_model

# Servers that accept vLLM's ignore_eos extension.
IGNORES_EOS = {"vllm": True, "transformers": False, "llama.cpp": True}
ANCHORS = REPO_ROOT.parent / "shared" / "anchors"


def server_command(server: str, port: int, dtype: str) -> tuple[list[str], str]:
    """(command line, the model name requests must carry)."""
    if server == "vllm":
        script = ANCHORS / "run_vllm_cpu.sh"
        if not script.exists():
            raise SystemExit(f"{script} is missing (run setup_vllm_cpu.sh beside it first)")
        return [str(script), str(port), dtype], "smollm2"
    if server == "transformers":
        model_dir = str(resolve_model("").hf_dir)   # the GGUF converted to HF files
        transformers = Path(sys.executable).parent / "transformers"
        return ([str(transformers), "serve", model_dir, "--continuous-batching", "--device",
                 "cpu", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port)],
                model_dir)
    binary = shutil.which("llama-server")
    if binary is None:
        raise SystemExit("llama-server is not on PATH (build llama.cpp first)")
    return ([binary, "-m", str(embedded_gguf_path()), "--host", "127.0.0.1", "--port",
             str(port), "-np", "32", "-c", str(32 * 512), "-t", str(os.cpu_count())],
            "SmolLM2-135M-Instruct")


def bench_args(server: str, n: int, input_len: int, output_len: int) -> list[str]:
    """`llm-mesh bench serve` flags of the run at concurrency n (the same for both; the
    seed is the concurrency, so every point has prompts of its own)."""
    return ["--workload", "random", "--input-len", str(input_len), "--output-len",
            str(output_len), *(["--ignore-eos"] if IGNORES_EOS[server] else []),
            "--max-concurrency", str(n), "--num-prompts", str(4 * n), "--warmup", "1",
            "--seed", str(1000 * n)]


def run_other(server_name: str, dtype: str, benches: list[list[str]],
              out: Path) -> tuple[str, list[BenchmarkMetrics]]:
    """Runs every bench against the other server; (its label, their metrics)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command, model = server_command(server_name, port, dtype)
    label = server_name.replace(".", "")
    with serving(command, url, out / f"{label}.server.log", env={"HF_HUB_OFFLINE": "1"},
                 stop_timeout_s=30):
        print(f"\n### {server_name}: {' '.join(command)}", flush=True)
        runs = [bench_serve(url, out / f"{label}.{index}.json", args, model=model)
                for index, args in enumerate(benches)]
    return label, runs


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=tuple(IGNORES_EOS), default="vllm")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--mesh-only-concurrency", default="",
                        help="concurrencies only the mesh runs (after the shared ones)")
    parser.add_argument("--mesh-args", default="", help="extra `llm-mesh up` flags")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "other")
    args = parser.parse_args(argv)
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(c) for c in args.concurrency.split(",")]
    mesh_only = [int(c) for c in args.mesh_only_concurrency.split(",") if c]
    benches = [bench_args(args.server, n, args.input_len, args.output_len)
               for n in sizes + mesh_only]
    label, theirs = run_other(args.server, args.dtype, benches[:len(sizes)], args.out)
    ours = run_config("mesh", ["--dtype", args.dtype, *shlex.split(args.mesh_args)], benches,
                      args.out)
    rows = [[n, f"{o.output_throughput:.1f}", f"{t.output_throughput:.1f}" if t else "-",
             f"{o.output_throughput / t.output_throughput:.2f}x" if t else "-",
             f"{_ms(o.itl, 'p99')} / {_ms(t.itl, 'p99') if t else '-'}",
             f"{_ms(o.tpot, 'p50')} / {_ms(t.tpot, 'p50') if t else '-'}"]
            for n, o, t in zip(sizes + mesh_only, ours, theirs + [None] * len(mesh_only),
                               strict=True)]
    print("\n" + markdown_table([
        "concurrency", "mesh tok/s", f"{args.server} tok/s", f"mesh / {args.server}",
        f"ITL P99 mesh / {args.server} (ms)", f"TPOT P50 mesh / {args.server} (ms)"], rows))
    plot = args.out / f"mesh-vs-{label}-{args.dtype}.png"
    write_plot(plot, {"llm-mesh": ours[:len(sizes)], args.server: theirs},
               title=f"random {args.input_len}/{args.output_len}, {args.dtype}, "
                     f"concurrency {args.concurrency}")
    print(f"wrote {plot}")


def _ms(distribution: Distribution | None, percentile: str) -> str:
    return f"{getattr(distribution, percentile):,.1f}" if distribution else "-"


if __name__ == "__main__":
    main()
