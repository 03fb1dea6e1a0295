"""Percentiles, TPOT, throughput and goodput on synthetic results (no server)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_mesh.bench.benchmark_metrics import (
    BenchmarkMetrics,
    Distribution,
    compute_metrics,
    meets_slos,
    parse_slos,
)
from llm_mesh.bench.report import build_json
from llm_mesh.bench.runner import BenchmarkPoint, RunResult, arrival_offsets
from llm_mesh.bench.stream_parser import RequestResult


def result(ttft: float, latency: float, output_tokens: int, prompt_tokens: int = 10,
           success: bool = True) -> RequestResult:
    gaps = ([(latency - ttft) / (output_tokens - 1)] * (output_tokens - 1)
            if output_tokens > 1 else [])
    return RequestResult(success=success, error="" if success else "HTTP 500: boom",
                         ttft=ttft, latency=latency, itl=gaps, prompt_tokens=prompt_tokens,
                         output_tokens=output_tokens, num_chunks=output_tokens)


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    assert result(0.1, 1.1, 11).tpot == pytest.approx(0.1)
    assert result(0.1, 0.1, 1).tpot is None  # undefined for one token


def test_distribution_percentiles_interpolate_linearly() -> None:
    values = [i / 1000.0 for i in range(1, 101)]  # 1..100 ms
    d = Distribution.of_seconds(values)
    assert d is not None
    assert d.mean == pytest.approx(50.5)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert d.count == 100
    assert Distribution.of_seconds([]) is None


def test_throughput_counts_only_successes() -> None:
    results = [result(0.1, 1.1, 11), result(0.2, 2.2, 21), result(0.3, 0.5, 5, success=False)]
    m = compute_metrics(RunResult(BenchmarkPoint(math.inf, 4), results, 2.0, 0.01))
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 20 and m.total_output_tokens == 32
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(16.0)
    assert m.total_token_throughput == pytest.approx(26.0)
    assert m.tpot is not None and m.tpot.p50 == pytest.approx(100.0)
    assert m.interactivity == pytest.approx(10.0)  # 1000 / 100 ms
    assert m.errors == {"HTTP 500: boom": 1}
    assert m.goodput is None  # no SLOs given
    assert m.label == "rate=inf c=4"


def test_a_run_read_back_from_its_json_report_is_the_same_run() -> None:
    results = [result(0.1, 1.1, 11), result(0.3, 0.5, 5, success=False)]
    m = compute_metrics(RunResult(BenchmarkPoint(math.inf, 4), results, 2.0, 0.01))
    [run] = build_json({}, [m], [results])["runs"]   # with per-request rows, as --save-detailed
    assert BenchmarkMetrics.from_json(run) == m


def test_goodput_needs_every_slo_met() -> None:
    slos = parse_slos(["ttft:150", "tpot:60"])
    assert slos == {"ttft": 150.0, "tpot": 60.0}
    fast = result(0.1, 0.6, 11)     # ttft 100 ms, tpot 50 ms
    slow_first = result(0.2, 0.7, 11)   # ttft 200 ms
    slow_decode = result(0.1, 1.1, 11)  # tpot 100 ms
    one_token = result(0.1, 0.1, 1)     # tpot counts as 0
    assert [meets_slos(r, slos) for r in (fast, slow_first, slow_decode, one_token)] == \
        [True, False, False, True]
    run = RunResult(BenchmarkPoint(2.0, None), [fast, slow_first, slow_decode, one_token], 2.0, 0)
    assert compute_metrics(run, slos).goodput == pytest.approx(1.0)  # 2 good / 2 s


def test_bad_slos_are_refused() -> None:
    for bad in (["ttft"], ["foo:1"], ["tpot:-5"]):
        with pytest.raises(ValueError):
            parse_slos(bad)
    assert parse_slos(["e2e:900"]) == {"e2el": 900.0}


def test_arrivals_are_poisson_at_the_rate_and_immediate_at_inf() -> None:
    assert not arrival_offsets(5, math.inf, 1.0, 0).any()
    offsets = arrival_offsets(20_000, 50.0, 1.0, 0)
    gaps = np.diff(offsets)
    assert offsets[0] == 0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / 50, rel=0.05)
    assert gaps.std() == pytest.approx(1 / 50, rel=0.05)  # exponential: std == mean
    bursty = np.diff(arrival_offsets(20_000, 50.0, 0.25, 0))
    assert bursty.mean() == pytest.approx(1 / 50, rel=0.1) and bursty.std() > 1.5 / 50
