"""`llm-mesh bench serve` run briefly against the real mesh (NATS + every service)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llm_mesh.cli import main as llm_mesh_main
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 16


def test_bench_serve_against_the_mesh(mesh: Mesh, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    result_json, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = llm_mesh_main([
        "bench", "serve", "--base-url", mesh.base_url, "--workload", "random",
        "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--sweep", "4,inf",
        "--goodput", "ttft:60000", "tpot:60000", "--result-json", str(result_json),
        "--plot", str(plot), "--no-progress"])
    out = capsys.readouterr().out
    print(out)
    assert rc == 0, mesh.logs()
    report = json.loads(result_json.read_text())
    assert [run["request_rate"] for run in report["runs"]] == [4.0, "inf"]
    for run in report["runs"]:
        assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0), run["errors"]
        assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # --ignore-eos: exact
        assert run["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN    # prompts built exactly
        assert run["output_throughput"] > 0 and run["request_throughput"] > 0
        assert run["goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs
        for key in ("ttft", "tpot", "itl", "e2el"):
            d = run[key]
            assert 0 < d["p50"] <= d["p90"] <= d["p99"], (key, d)
        assert run["ttft"]["p99"] <= run["e2el"]["p99"]
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert "Serving Benchmark Result: rate=4" in out
