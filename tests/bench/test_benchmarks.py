"""The comparison benchmarks (benchmarks/): each one imports and parses its options, the
imports run one way (benchmarks → llm_mesh.bench), and the shared harness and the runner's
phase timer work as the scripts rely on, without a model or a mesh."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks
from benchmarks.harness import (distribution, log_events, markdown_table, metrics_url,
                                service_health_urls, sum_of)

REPO_ROOT = Path(__file__).resolve().parents[2]
HELPERS = {"harness", "cpu_accounting", "spec_compare"}   # shared by benchmarks, not one
BENCHMARKS = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                    if m.name not in HELPERS)


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_imports_and_prints_its_help(name: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_llm_mesh_never_imports_the_benchmarks() -> None:
    for path in (REPO_ROOT / "llm_mesh").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("benchmarks", "scripts") for n in names), path


def test_sum_of_adds_every_series_of_one_sample() -> None:
    text = ("# HELP llm_mesh:x_total x\nllm_mesh:x_total{a=\"1\"} 2.5\n"
            "llm_mesh:x_total{a=\"2\"} 1\nllm_mesh:x_total_other 100\nllm_mesh:y 7\n")
    assert sum_of(text, "llm_mesh:x_total") == 3.5
    assert sum_of(text, "llm_mesh:y") == 7
    assert sum_of(text, "llm_mesh:absent") == 0
    assert sum_of(text, "llm_mesh:x_total", 'a="2"') == 1


def test_the_step_plane_bench_times_the_codec_and_a_channel_round_trip(
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import step_plane
    step_plane.main(["--rows", "2", "--steps", "20"])
    out = capsys.readouterr().out
    assert "| channel round trip |" in out
    assert "2 rows: a step's codec" in out


def test_the_mesh_log_gives_each_service_health_url(tmp_path: Path) -> None:
    log = tmp_path / "mesh.log"
    log.write_text('nats-server starting\n'
                   '{"event": "started service", "service": "gateway", '
                   '"health": "http://127.0.0.1:1/ready"}\n'
                   '{"event": "kvstore serving", "address": "127.0.0.1:2"}\n'
                   '{"event": "started service", "service": "scheduler", "engine": "engine-0", '
                   '"health": "http://127.0.0.1:3/ready"}\n'
                   '{"event": "started service", "service": "scheduler", "engine": "engine-1", '
                   '"health": "http://127.0.0.1:4/ready"}\n')
    assert [e["event"] for e in log_events(log)] == ["started service", "kvstore serving",
                                                     "started service", "started service"]
    assert service_health_urls(log) == {  # -dp 2: each engine's scheduler, not the last one
        "gateway": "http://127.0.0.1:1/ready",
        "scheduler.engine-0": "http://127.0.0.1:3/ready",
        "scheduler.engine-1": "http://127.0.0.1:4/ready"}
    assert metrics_url("http://127.0.0.1:1/ready") == "http://127.0.0.1:1/metrics"


def test_markdown_table_and_distribution() -> None:
    assert markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"
    d = distribution([0.001, 0.002, 0.003])
    assert (d.p50, d.count) == (pytest.approx(2.0), 3)   # milliseconds
    with pytest.raises(ValueError):
        distribution([])


class FakeRunner:
    """The calls StepPhases splits a step at, each sleeping a known least time."""

    def __init__(self) -> None:
        self.device = SimpleNamespace(type="cpu")
        self.model = SimpleNamespace(compute_logits=lambda hidden: time.sleep(0.004))
        self.attn_backend = SimpleNamespace(forward=lambda: time.sleep(0.005))
        self.sampler = lambda logits: time.sleep(0.003)

    def _execute(self) -> None:
        time.sleep(0.002)                 # prepare
        self.model.compute_logits(self._forward())
        self.sampler(None)
        time.sleep(0.006)                 # output

    def _forward(self) -> None:
        for _ in range(2):
            self.attn_backend.forward()
        time.sleep(0.001)


def test_step_phases_split_a_step_at_the_runners_calls() -> None:
    from benchmarks.runner import StepPhases

    runner = FakeRunner()
    phases = StepPhases(runner)  # type: ignore[arg-type]
    for _ in range(2):  # the second step's figures replace the first's
        runner._execute()
    s = phases.seconds
    assert s["prepare"] >= 0.002 and s["sample"] >= 0.003 and s["output"] >= 0.006
    # NOTE: lower bounds only: a sleep is never shorter, a loaded machine makes it longer.
    # Attention is inside forward, and only the last step's (else it would pass forward).
    assert s["attention"] >= 0.010 and s["forward"] >= s["attention"] + 0.005
