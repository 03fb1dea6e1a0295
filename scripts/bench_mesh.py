"""Benchmarks the whole mesh the way users run it: `llm-mesh up` with the given flags, then
`llm-mesh bench serve` against it, then a clean stop. Several configurations run one after
the other in one invocation, so a comparison is measured in one run on one machine.

    python scripts/bench_mesh.py \
        --config "fp32=--dtype float32" --config "bf16=--dtype bfloat16" \
        --bench "--workload random --input-len 128 --output-len 128 --ignore-eos \
                 --max-concurrency 8 --num-prompts 16"

Each --bench runs in turn against each configuration's mesh. Prints the bench reports, the
mesh overhead (the share of engine step time spent in NATS messaging and serialization,
from the scheduler's metrics) and writes JSON results and every service's /metrics under
--out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from llm_mesh.embedded import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server is not ready:\n{log.read_text()[-4000:]}")


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def sum_of(metrics: str, name: str) -> float:
    """The sum of every series of a Prometheus sample named `name` (all label sets)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith((f"{name}{{", f"{name} ")))


def scrape_services(log: Path, label: str, out_dir: Path) -> None:
    """Saves each service's own /metrics (health URLs from `llm-mesh up`'s log) and prints
    the mesh overhead the scheduler measured over the whole run."""
    for line in log.read_text().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") != "started service":
            continue
        service = event["service"]
        text = scrape(event["health"].replace("/ready", "/metrics"))
        (out_dir / f"{label}.{service}-metrics.txt").write_text(text)
        if service == "scheduler":
            step = sum_of(text, "llm_mesh:engine_step_seconds_sum")
            messaging = sum_of(text, "llm_mesh:step_messaging_seconds_sum")
            steps = sum_of(text, "llm_mesh:engine_step_seconds_count")
            if steps:
                print(f"mesh overhead ({label}): {steps:.0f} steps, step {1e3 * step / steps:.2f}"
                      f" ms mean, NATS messaging + serialization "
                      f"{1e3 * messaging / steps:.2f} ms mean = {100 * messaging / step:.1f}% "
                      f"of step time", flush=True)


def run_config(label: str, up_args: list[str], benches: list[list[str]], out_dir: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out_dir / f"{label}.mesh.log"
    with open(log, "wb") as log_file:
        mesh = subprocess.Popen(
            [sys.executable, "-m", "llm_mesh.cli", "up", "--port", str(port), "--log-format",
             "json", *up_args], stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        wait_healthy(url, mesh, log)
        print(f"\n### {label}: llm-mesh up {' '.join(up_args)}", flush=True)
        for index, bench_args in enumerate(benches):
            subprocess.run([sys.executable, "-m", "llm_mesh.bench", "serve", "--base-url", url,
                            "--result-json", str(out_dir / f"{label}.{index}.json"),
                            "--no-progress", *bench_args], check=True, cwd=REPO_ROOT)
        (out_dir / f"{label}.gateway-metrics.txt").write_text(scrape(f"{url}/metrics"))
        scrape_services(log, label, out_dir)
    finally:
        mesh.send_signal(signal.SIGINT)
        mesh.wait(timeout=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", action="append", required=True,
                        help='"label=<llm-mesh up flags>"; repeat to compare')
    parser.add_argument("--bench", action="append", required=True,
                        help="llm-mesh bench serve flags; repeat to run several in turn")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for config in args.config:
        label, _, flags = config.partition("=")
        run_config(label, shlex.split(flags), [shlex.split(b) for b in args.bench], args.out)


if __name__ == "__main__":
    main()
