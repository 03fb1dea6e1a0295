"""`llm-mesh bench serve` against a second OpenAI-compatible server on the same model and
workload: `transformers serve` (transformers' own server, with its continuous batching and
paged attention) or llama.cpp's `llama-server` on the embedded GGUF, where one is installed.

    python -m benchmarks.other_server --server transformers --dtype float32 \
        --concurrency 1,8,32 --out bench-results/other

Then `llm-mesh up` serves the same runs (benchmarks/mesh.py), and a table of the two
with their ratio closes the run. The server runs in its own process on a random loopback
port; each concurrency runs the `random` workload (128/128, 4 x concurrency prompts, one
warm-up request) and each report and JSON lands under --out. `transformers serve` refuses
vLLM's `ignore_eos` (HTTP 422), so its requests may end at EOS before 128 tokens: the
report counts the tokens actually generated.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import REPO_ROOT, bench_serve, markdown_table, print_preamble, serving
from benchmarks.mesh import run_config
from llm_mesh.bench.metrics import BenchmarkMetrics
from llm_mesh.bench.plot import write_plot
from llm_mesh.embedded import free_port
from services.common.model_files import embedded_gguf_path, resolve_model

# Servers that accept vLLM's ignore_eos extension.
IGNORES_EOS = {"transformers": False, "llama.cpp": True}


def server_command(server: str, port: int, dtype: str) -> tuple[list[str], str]:
    """(command line, the model name requests must carry)."""
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
    """`llm-mesh bench serve` flags of the run at concurrency n (the same for both)."""
    return ["--workload", "random", "--input-len", str(input_len), "--output-len",
            str(output_len), *(["--ignore-eos"] if IGNORES_EOS[server] else []),
            "--max-concurrency", str(n), "--num-prompts", str(4 * n), "--warmup", "1"]


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
    parser.add_argument("--server", choices=("transformers", "llama.cpp"),
                        default="transformers")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "other")
    args = parser.parse_args(argv)
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(c) for c in args.concurrency.split(",")]
    benches = [bench_args(args.server, n, args.input_len, args.output_len) for n in sizes]
    label, theirs = run_other(args.server, args.dtype, benches, args.out)
    ours = run_config("mesh", ["--dtype", args.dtype], benches, args.out)
    rows = [[n, f"{o.output_throughput:.1f}", f"{t.output_throughput:.1f}",
             f"{o.output_throughput / t.output_throughput:.2f}x",
             f"{o.tpot.p50:.1f}" if o.tpot else "-", f"{t.tpot.p50:.1f}" if t.tpot else "-"]
            for n, o, t in zip(sizes, ours, theirs, strict=True)]
    print("\n" + markdown_table(["concurrency", "mesh tok/s", f"{args.server} tok/s",
                                 f"mesh / {args.server}", "mesh TPOT P50 ms",
                                 f"{args.server} TPOT P50 ms"], rows))
    plot = args.out / f"mesh-vs-{label}.png"
    write_plot(plot, {"llm-mesh": ours, args.server: theirs},
               title=f"random {args.input_len}/{args.output_len}, {args.dtype}, "
                     f"concurrency {args.concurrency}")
    print(f"wrote {plot}")


if __name__ == "__main__":
    main()
