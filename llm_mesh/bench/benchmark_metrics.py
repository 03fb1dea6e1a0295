"""Statistics of one benchmark point, with vLLM's definitions so numbers compare.

- TTFT: send → first chunk with text. E2E: send → end of stream.
- TPOT per request: (E2E − TTFT) / (output_tokens − 1); requests with one token have none.
- ITL: every gap between consecutive content chunks, pooled over all requests.
- Throughput: totals over the wall time from the first send to the last response.
- Goodput: successful requests per second that meet every given SLO (ms); a one-token
  request counts TPOT as 0, as vLLM does.
- Prefix-cache hit rate: `usage.prompt_tokens_details.cached_tokens` summed over the
  successful requests that report it, over their prompt tokens summed.
- Multi-turn: TTFT of every session's first turn apart from its later turns (whose history
  a cache may hold), and the TTFT P50 of each turn index.
Percentiles interpolate linearly (numpy's default, as vLLM's bench).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from llm_mesh.bench.runner import RunResult
from llm_mesh.bench.stream_parser import RequestResult

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """Milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution | None:
        if not values:
            return None
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99, len(ms))


def parse_slos(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] → {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = item.partition(":")
        name = {"e2e": "e2el"}.get(name.strip().lower(), name.strip().lower())
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {item!r}: use NAME:MS with NAME in ttft, tpot, e2el")
        ms = float(value)
        if ms <= 0:
            raise ValueError(f"bad SLO {item!r}: the limit must be positive")
        slos[name] = ms
    return slos


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    measured_ms = {"ttft": result.ttft * 1000.0, "tpot": (result.tpot or 0.0) * 1000.0,
                   "e2el": result.latency * 1000.0}
    return all(measured_ms[name] <= limit for name, limit in slos.items())


@dataclass
class BenchmarkMetrics:
    label: str
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float           # completed requests / s
    output_throughput: float            # generated tokens / s
    total_token_throughput: float       # (prompt + generated) tokens / s
    interactivity: float | None         # generated tokens / s per user: 1000 / median TPOT
    goodput: float | None               # requests / s meeting every SLO; None without SLOs
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    client_cpu_s: float
    client_cpu_us_per_chunk: float | None
    errors: dict[str, int] = field(default_factory=dict)    # the commonest failure messages
    total_cached_tokens: int | None = None      # None: the server reported no cached_tokens
    prefix_cache_hit_rate: float | None = None  # cached / prompt tokens, 0..1
    ttft_first_turn: Distribution | None = None     # multi-turn only, as the next two
    ttft_later_turns: Distribution | None = None
    ttft_p50_by_turn: list[float] | None = None     # ms; index 0 is turn 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, run: dict[str, Any]) -> BenchmarkMetrics:
        """A run as `to_json` wrote it (extra keys, e.g. per-request rows, ignored)."""
        fields = {k: v for k, v in run.items() if k in cls.__dataclass_fields__}
        # NOTE: JSON has no infinity: the report writes an unbounded rate as "inf".
        fields["request_rate"] = float(fields["request_rate"])
        for name in ("ttft", "tpot", "itl", "e2el", "ttft_first_turn", "ttft_later_turns"):
            if fields.get(name) is not None:
                fields[name] = Distribution(**fields[name])
        return cls(**fields)


def compute_metrics(run: RunResult, slos: dict[str, float] | None = None) -> BenchmarkMetrics:
    ok = [r for r in run.results if r.success]
    failed = [r for r in run.results if not r.success]
    duration = max(run.duration_s, 1e-9)
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    tpot = Distribution.of_seconds(tpots)
    num_chunks = sum(r.num_chunks for r in run.results)
    reporting = [r for r in ok if r.cached_tokens is not None]
    total_cached = sum(r.cached_tokens or 0 for r in reporting) if reporting else None
    reported_prompt = sum(r.prompt_tokens for r in reporting)
    turns = sorted({r.turn for r in ok if r.turn})
    return BenchmarkMetrics(
        label=run.point.label,
        request_rate=run.point.request_rate,
        max_concurrency=run.point.max_concurrency,
        completed=len(ok),
        failed=len(failed),
        duration_s=run.duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        interactivity=1000.0 / tpot.p50 if tpot and tpot.p50 > 0 else None,
        goodput=(sum(meets_slos(r, slos) for r in ok) / duration) if slos else None,
        ttft=Distribution.of_seconds([r.ttft for r in ok]),
        tpot=tpot,
        itl=Distribution.of_seconds([gap for r in ok for gap in r.itl]),
        e2el=Distribution.of_seconds([r.latency for r in ok]),
        client_cpu_s=run.client_cpu_s,
        client_cpu_us_per_chunk=run.client_cpu_s * 1e6 / num_chunks if num_chunks else None,
        errors=dict(Counter(r.error for r in failed).most_common(5)),
        total_cached_tokens=total_cached,
        prefix_cache_hit_rate=(total_cached / reported_prompt
                               if total_cached is not None and reported_prompt else None),
        ttft_first_turn=Distribution.of_seconds([r.ttft for r in ok if r.turn == 1]),
        ttft_later_turns=Distribution.of_seconds([r.ttft for r in ok if r.turn > 1]),
        ttft_p50_by_turn=[float(np.percentile([r.ttft * 1000.0 for r in ok if r.turn == t], 50))
                          for t in turns] or None,
    )
