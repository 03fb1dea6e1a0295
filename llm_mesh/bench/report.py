"""The printed report (a detail block per point, a table per sweep) and the JSON file."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llm_mesh.bench.benchmark_metrics import BenchmarkMetrics, Distribution
from llm_mesh.bench.stream_parser import RequestResult

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E"))


def _num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _rate(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:g}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def format_detail(m: BenchmarkMetrics, num_devices: int = 1) -> str:
    """One point in the layout of `vllm bench serve`."""
    rows: list[tuple[str, str]] = [
        ("Request rate (req/s)", _rate(m.request_rate)),
        ("Max concurrency", "-" if m.max_concurrency is None else str(m.max_concurrency)),
        ("Successful requests", str(m.completed)),
        ("Failed requests", str(m.failed)),
        ("Benchmark duration (s)", _num(m.duration_s)),
        ("Total input tokens", str(m.total_input_tokens)),
        ("Total generated tokens", str(m.total_output_tokens)),
        ("Request throughput (req/s)", _num(m.request_throughput)),
        ("Output token throughput (tok/s)", _num(m.output_throughput)),
        ("Output tok/s per GPU/CPU", _num(m.output_throughput / num_devices)),
        ("Total token throughput (tok/s)", _num(m.total_token_throughput)),
        ("Interactivity (tok/s per user)", _num(m.interactivity)),
    ]
    if m.goodput is not None:
        rows.append(("Goodput (req/s)", _num(m.goodput)))
    if m.prefix_cache_hit_rate is not None:
        rows += [("Total cached prompt tokens", str(m.total_cached_tokens)),
                 ("Prefix cache hit rate", _share(m.prefix_cache_hit_rate))]
    for key, name in LATENCIES:
        dist: Distribution | None = getattr(m, key)
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat.capitalize() if stat == 'mean' else stat.upper()} "
                         f"{name} (ms)", _num(getattr(dist, stat) if dist else None)))
    for name, turns in (("turn 1", m.ttft_first_turn), ("turns 2+", m.ttft_later_turns)):
        if turns is not None:
            rows += [(f"P50 TTFT {name} (ms)", _num(turns.p50)),
                     (f"P99 TTFT {name} (ms)", _num(turns.p99))]
    rows.append(("Client CPU (s, us/chunk)",
                 f"{m.client_cpu_s:.2f}, {_num(m.client_cpu_us_per_chunk, 1)}"))
    width = max(len(name) for name, _ in rows) + 2
    title = f" Serving Benchmark Result: {m.label} "
    lines = [title.center(width + 12, "=")]
    lines += [f"{name:<{width}}{value:>12}" for name, value in rows]
    if m.ttft_p50_by_turn:
        lines.append("P50 TTFT by turn (ms): " + " ".join(f"{v:.1f}" for v in m.ttft_p50_by_turn))
    lines += [f"error x{count}: {message}" for message, count in m.errors.items()]
    lines.append("=" * (width + 12))
    return "\n".join(lines)


def format_sweep(metrics: Sequence[BenchmarkMetrics], num_devices: int = 1) -> str:
    """One row per point: throughput first, then each latency as p50/p90/p99 (mean)."""
    header = ["point", "ok", "fail", "req/s", "out tok/s", f"/dev({num_devices})", "tot tok/s",
              "tok/s/user", "goodput", "cache hit"]
    header += [f"{name} p50/p90/p99 (mean) ms" for _, name in LATENCIES]
    rows = [header]
    for m in metrics:
        row = [m.label, str(m.completed), str(m.failed), _num(m.request_throughput),
               _num(m.output_throughput, 1), _num(m.output_throughput / num_devices, 1),
               _num(m.total_token_throughput, 1), _num(m.interactivity, 1), _num(m.goodput),
               _share(m.prefix_cache_hit_rate)]
        for key, _ in LATENCIES:
            d: Distribution | None = getattr(m, key)
            row.append("-" if d is None else
                       f"{d.p50:.1f}/{d.p90:.1f}/{d.p99:.1f} ({d.mean:.1f})")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def _jsonable(value: Any) -> Any:
    """JSON has no Infinity: an unbounded rate is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def build_json(config: dict[str, Any], metrics: Sequence[BenchmarkMetrics],
               details: Sequence[Sequence[RequestResult]] | None = None) -> dict[str, Any]:
    runs = []
    for i, m in enumerate(metrics):
        run = m.to_json()
        if details is not None:
            run["requests"] = [asdict(r) for r in details[i]]
        runs.append(run)
    return _jsonable({"config": config, "runs": runs})


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
