"""A worker that dies and never returns: after --worker-rejoin-timeout-s its scheduler gives
its requests up as movable, and the gateway continues them on the other engine — the
clients' streams complete, identical to an undisturbed run, instead of ending in errors.

Its own two-engine mesh (the shared fault mesh waits 60 s for a worker to return)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.conftest import PROMPTS, bodies, complete, gateway_metric, metric
from tests.faults.streams import StreamSet
from tests.mesh import Mesh, serving

pytestmark = pytest.mark.slow

REJOIN_TIMEOUT = ["--worker-rejoin-timeout-s", "3"]
ENGINES = {"scheduler": "worker", "scheduler-engine-1": "worker-engine-1"}


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = Mesh(Path(tmp_path_factory.mktemp("worker-lost")), namespace="worker-lost",
                extra_args={"scheduler": REJOIN_TIMEOUT,
                            "gateway": ["--migration-timeout-s", "30"]}, worker_threads=1)
    # The killed worker exits by SIGKILL: no clean-exit check.
    with serving(mesh, lambda m: m.add_engine("engine-1", scheduler_args=REJOIN_TIMEOUT),
                 check_exit=False) as running:
        yield running


def test_requests_of_a_worker_that_never_returns_move_to_the_other_engine(
        two_engines: Mesh) -> None:
    mesh = two_engines
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reference = list(pool.map(lambda p: complete(mesh, p)["choices"][0]["text"], PROMPTS))
    moved = gateway_metric(mesh, "llm_mesh:request_migrations_total", outcome="moved")
    streams = StreamSet(mesh.base_url, bodies())
    streams.wait_for_chunks(3)
    doomed = max(sorted(ENGINES), key=lambda s: metric(mesh, s, "vllm:num_requests_running"))
    survivor = next(s for s in ENGINES if s != doomed)
    num_held = metric(mesh, doomed, "vllm:num_requests_running")
    finished_on_survivor = metric(mesh, survivor, "vllm:request_success_total")
    killed = time.monotonic()
    mesh.services[ENGINES[doomed]].stop(signal.SIGKILL)     # and it stays dead
    results = streams.finish(120)
    assert [r.outcome() for r in results] == ["completed (length)"] * len(results)
    assert [r.text for r in results] == reference           # continued, nothing lost
    num_moved = gateway_metric(mesh, "llm_mesh:request_migrations_total",
                               outcome="moved") - moved
    assert num_moved >= num_held >= 1
    assert metric(mesh, survivor, "vllm:request_success_total") \
        - finished_on_survivor >= num_held
    moves = [json.loads(line) for line in
             mesh.services["gateway"].log_path.read_text().splitlines()
             if '"request moved"' in line]
    assert moves and all(m["reason"] == "the engine's worker is gone" for m in moves)
    print(json.dumps({"fault": "worker SIGKILL, never restarted", "moved": num_moved,
                      "all_done_after_s": round(max(r.ended for r in results) - killed, 2)}))
