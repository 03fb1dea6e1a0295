"""How long each service takes from exec to ready when nothing changed (the model already
converted, the C++ kernels already built): what a restart after a crash costs.

Starts a throwaway nats-server, then starts each service --repeats times in turn (one at a
time, alone on the machine), and reads the `ready` line each one logs: the seconds since
exec, and its start-up phases. Prints the median per service and one run's phases.

    .venv/bin/python -m benchmarks.restart
    .venv/bin/python -m benchmarks.restart --services worker --repeats 5 --worker-args="--kv-cache-memory 536870912"
    .venv/bin/python -m benchmarks.restart --repo /tmp/before      # another checkout's code
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llm_mesh.embedded import EmbeddedNats, free_port
from llm_mesh.service_modules import SERVICE_MODULES

REPO_ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("worker", "tokenizer", "scheduler", "gateway", "batch", "kvstore")


def start_to_ready(repo: Path, nats_url: str, service: str, args: list[str],
                   timeout_s: float = 300.0) -> tuple[float, dict[str, Any]]:
    """Seconds from exec to the service's `ready` line, and that line."""
    argv = [sys.executable, "-m", SERVICE_MODULES[service], "--nats-url", nats_url,
            "--log-format", "json", "--health-port", str(free_port()), *args]
    if service == "gateway":
        argv += ["--port", str(free_port())]
    started = time.monotonic()
    process = subprocess.Popen(argv, cwd=repo, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, env={**os.environ,
                                                              "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        for raw in process.stdout:
            if time.monotonic() - started > timeout_s:
                break
            if not raw.startswith(b"{"):
                continue
            event = json.loads(raw)
            if event.get("event") == "ready":
                return time.monotonic() - started, event
        raise RuntimeError(f"{service} did not log `ready` (exit code {process.poll()})")
    finally:
        process.kill()
        process.wait()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", default=",".join(SERVICES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--repo", type=Path, default=REPO_ROOT,
                        help="the checkout whose services to start")
    parser.add_argument("--worker-args", default="", help="extra worker flags (quoted)")
    args = parser.parse_args(argv)
    extra = {"worker": shlex.split(args.worker_args)}
    print(f"CPU: {_cpu_name()}, {os.cpu_count()} cores; code: {args.repo}")
    print("| service | exec -> ready, median (s) | runs (s) | phases of the median run (s) |")
    print("|---|---|---|---|")
    with EmbeddedNats() as nats:
        for service in args.services.split(","):
            runs = [start_to_ready(args.repo, nats.url, service, extra.get(service, []))
                    for _ in range(args.repeats)]
            runs.sort(key=lambda run: run[0])
            seconds, event = runs[len(runs) // 2]
            phases = ", ".join(f"{k} {v}" for k, v in (event.get("phases") or {}).items())
            print(f"| {service} | {seconds:.2f} | {', '.join(f'{s:.2f}' for s, _ in runs)} "
                  f"| {phases or '(not logged)'} |", flush=True)


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    main()
