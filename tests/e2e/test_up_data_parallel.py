"""`llm-mesh up --data-parallel-size 2`: two engines (scheduler + worker pairs) behind one
API, both serving, the cores split between their workers; one engine's worker killed, the
other keeps serving while the launcher restarts it; then a clean stop."""

from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.chaos.up_mesh import UpMesh
from tests.e2e.up_processes import argv_of, children_of, launcher_events, service_of
from tests.faults.streams import poll
from tests.mesh import http_get, http_post, metric_value

pytestmark = pytest.mark.slow

ENGINES = ("engine-0", "engine-1")


def health_url(mesh: UpMesh, service: str, engine: str) -> str:
    """The service's /ready, from the launcher's `started service` line (a restart keeps it)."""
    [started] = [e for e in launcher_events(mesh.log_path, "started service")
                 if e["service"] == service and e.get("engine") == engine]
    return started["health"]


def worker_of(mesh: UpMesh, engine: str) -> int | None:
    for pid in children_of(mesh.launcher.pid):
        if service_of(pid) == "worker" and engine.encode() in argv_of(pid):
            return pid
    return None


def requests_served(mesh: UpMesh, engine: str) -> float:
    url = health_url(mesh, "scheduler", engine).replace("/ready", "/metrics")
    status, body = http_get(url)
    assert status == 200, f"{engine}'s scheduler /metrics answered {status}"
    try:
        return metric_value(body.decode(), "vllm:request_success_total", engine=engine)
    except KeyError:   # no request finished there yet
        return 0.0


def complete_all(mesh: UpMesh, count: int) -> None:
    """`count` concurrent greedy completions (distinct short prompts: no shared prefix to
    route by); every one must succeed."""
    def complete(i: int) -> int:
        status, body = http_post(f"{mesh.base_url}/v1/completions",
                                 {"model": "SmolLM2-135M-Instruct", "prompt": f"{i} + {i} =",
                                  "max_tokens": 4, "temperature": 0}, timeout=150)
        assert status == 200 and body["usage"]["completion_tokens"] >= 1, body
        return status
    with ThreadPoolExecutor(count) as pool:
        assert list(pool.map(complete, range(count))) == [200] * count


def test_two_engines_serve_and_one_survives_the_others_worker(tmp_path: Path) -> None:
    mesh = UpMesh(tmp_path / "up.log", ["--data-parallel-size", "2"])
    try:
        mesh.wait_healthy(300)
        # The launcher calls the mesh ready once both engines are.
        poll(lambda: bool(launcher_events(mesh.log_path, "mesh ready")), 120,
             "the launcher to see both engines ready", interval_s=0.2)
        [ready] = launcher_events(mesh.log_path, "mesh ready")
        assert ready["engines"] == 2
        [plan] = launcher_events(mesh.log_path, "starting engines")
        assert plan["engine_ids"] == list(ENGINES)
        assert plan["threads_per_engine"] == max(1, len(os.sched_getaffinity(0)) // 2)
        services = json.loads(http_get(f"{mesh.base_url}/health")[1])["services"]
        assert services["scheduler"] == services["worker"] == "2 ready", services

        complete_all(mesh, 8)
        assert all(requests_served(mesh, engine) > 0 for engine in ENGINES), \
            {engine: requests_served(mesh, engine) for engine in ENGINES}

        dead = worker_of(mesh, "engine-1")
        assert dead is not None and worker_of(mesh, "engine-0") not in (None, dead)
        os.kill(dead, signal.SIGKILL)
        complete_all(mesh, 4)   # engine-0 serves; any sent to engine-1 wait for its worker
        poll(lambda: worker_of(mesh, "engine-1") not in (None, dead), 30,
             "the launcher to restart engine-1's worker", interval_s=0.2)
        assert any(e["service"] == "worker" and e.get("engine") == "engine-1"
                   and e["code"] == -signal.SIGKILL
                   for e in launcher_events(mesh.log_path, "service exited; restarting it"))
        poll(lambda: http_get(health_url(mesh, "worker", "engine-1"))[0] == 200, 180,
             "engine-1's restarted worker to be ready", interval_s=0.5)
    finally:
        code = mesh.stop()
    assert code == 0, mesh.log_tail()
