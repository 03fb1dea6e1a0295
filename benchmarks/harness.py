"""What the comparison benchmarks share, so each of them holds only its own measurement.

- The run's preamble: the command and the machine (CPU name, cores, vector ISA), printed
  first, because a figure means nothing without them (docs/benchmarks.md: compare within a
  table, never across machines).
- Servers under test: `serving` starts any command that answers `GET /health`, waits for it
  and stops it (SIGINT, then kill); `mesh_up` is that for `llm-mesh up` on a free port, with
  its JSON log parsed by `log_events` / `service_health_urls`.
- Client side: `bench_serve` runs `llm-mesh bench serve` against a URL and returns its
  metrics; `distribution` is its percentile definition (numpy's linear, as vLLM's) for any
  list of seconds, so every script reads P50 / P99 the same way.
- Prometheus text: `scrape` and `sum_of`. Tables: `markdown_table`. Progress: `progress`.

The direction is one way: benchmarks import `llm_mesh.bench` (the user-facing load
generator); nothing under `llm_mesh/` imports from here.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics, Distribution
from llm_mesh.embedded import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def cpu_name() -> str:
    """The CPU's model name, its logical cores and its widest vector ISA (x86: avx512 / avx2)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() in ("flags", "Features"):
                    flags = set(value.split())
                    break
    except OSError:
        pass
    isa = next((f for f in ("avx512_bf16", "avx512f", "avx2") if f in flags), "")
    return f"{name}, {os.cpu_count()} logical cores" + (f", {isa}" if isa else "")


def print_preamble() -> None:
    """The command as typed from the repository root, then the machine it runs on."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    script = ["-m", spec.name] if spec is not None else [sys.argv[0]]
    command = [os.path.relpath(sys.executable), *script, *sys.argv[1:]]
    print(f"command: {shlex.join(command)}\nmachine: {cpu_name()}", flush=True)


def distribution(seconds: Sequence[float]) -> Distribution:
    """Mean, P50, P90, P99 in milliseconds; the same definition `llm-mesh bench serve` uses."""
    d = Distribution.of_seconds(seconds)
    if d is None:
        raise ValueError("no samples measured")
    return d


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


# --- servers under test ----------------------------------------------------------------

def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


@contextmanager
def serving(command: Sequence[str], url: str, log: Path, env: dict[str, str] | None = None,
            ready_timeout_s: float = 600, stop_timeout_s: float = 90) -> Iterator[None]:
    """Runs `command` (logging to `log`) while the block runs, once `url`/health answers."""
    with open(log, "wb") as log_file:
        process = subprocess.Popen(list(command), stdout=log_file, stderr=subprocess.STDOUT,
                                   cwd=REPO_ROOT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    try:
        deadline = time.monotonic() + ready_timeout_s
        while not is_healthy(url):
            if process.poll() is not None:
                raise RuntimeError(f"the server exited:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server is not ready:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield process
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass(frozen=True)
class RunningMesh:
    url: str
    log: Path       # `llm-mesh up --log-format json`: one JSON event a line
    pid: int        # the launcher's: its children are the services and servers


@contextmanager
def mesh_up(up_args: Sequence[str], log: Path) -> Iterator[RunningMesh]:
    """`llm-mesh up` with the given flags on a free port, stopped when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "llm_mesh.cli", "up", "--port", str(port),
               "--log-format", "json", *up_args]
    with serving(command, url, log) as process:
        yield RunningMesh(url, log, process.pid)


def log_events(log: Path) -> Iterator[dict[str, Any]]:
    """The JSON events of a mesh log. Children share the launcher's stdout, so two lines can
    land interleaved on one: such a line is skipped."""
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


def service_health_urls(log: Path) -> dict[str, str]:
    """{service: its /ready URL} of every service `llm-mesh up` started; an engine's
    services as `scheduler.engine-1` (with `-dp N` each engine has its own)."""
    return {(f"{e['service']}.{e['engine']}" if e.get("engine") else e["service"]): e["health"]
            for e in log_events(log) if e.get("event") == "started service"}


def metrics_url(health_url: str) -> str:
    return health_url.replace("/ready", "/metrics")


# --- the client side and the servers' metrics ---------------------------------------------

def bench_serve(url: str, result_json: Path, bench_args: Sequence[str],
                model: str | None = None) -> BenchmarkMetrics:
    """One `llm-mesh bench serve` run (its report printed as it goes); its first point."""
    subprocess.run([sys.executable, "-m", "llm_mesh.bench", "serve", "--base-url", url,
                    *(["--model", model] if model else []), "--no-progress",
                    "--result-json", str(result_json), *bench_args], check=True, cwd=REPO_ROOT)
    return BenchmarkMetrics.from_json(json.loads(result_json.read_text())["runs"][0])


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def sum_of(metrics: str, name: str, label: str = "") -> float:
    """The sum of every series of a Prometheus sample named `name` (all label sets, or
    those holding `label`, e.g. 'hop="back"')."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith((f"{name}{{", f"{name} ")) and label in line)
