"""`llm-mesh up` as a user runs it: one command, a working API, and a clean stop."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.ports import free_port
from tests.e2e.up_processes import children_of, service_of
from tests.faults.streams import poll
from tests.mesh import ENGINE_ARGS, REPO_ROOT, http_get, http_post

pytestmark = pytest.mark.slow


def test_up_serves_then_stops_every_process(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "up.log", "wb")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "llm_mesh.cli", "up", "--port", str(port), "--log-format",
         "json", *ENGINE_ARGS], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while http_get(f"http://127.0.0.1:{port}/health")[0] != 200:
            assert launcher.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "up.log").read_text()
            time.sleep(0.2)
        children = children_of(launcher.pid)
        # nats-server, valkey-server and six services (with the batch runner and a kvstore)
        assert len(children) == 8
        # The worker keeps the launcher's priority; the other services take the cores only
        # when its threads leave them (SCHED_IDLE).
        own = os.getpriority(os.PRIO_PROCESS, launcher.pid)
        policy = {service_of(pid): os.sched_getscheduler(pid)
                  for pid in children if service_of(pid)}
        assert policy == {"gateway": os.SCHED_IDLE, "batch": os.SCHED_IDLE,
                          "tokenizer": os.SCHED_IDLE, "scheduler": os.SCHED_IDLE,
                          "worker": os.SCHED_OTHER, "kvstore": os.SCHED_IDLE}
        worker = next(pid for pid in children if service_of(pid) == "worker")
        assert os.getpriority(os.PRIO_PROCESS, worker) == own
        status, body = http_post(f"http://127.0.0.1:{port}/v1/completions",
                                 {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                  "max_tokens": 4, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        # The launcher says so once its own readiness poll sees the mesh (which may come
        # after the gateway already answers).
        poll(lambda: b'"mesh ready"' in (tmp_path / "up.log").read_bytes(), 30,
             "the launcher to log that the mesh is ready")
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=60)
    assert code == 0, (tmp_path / "up.log").read_text()
    assert all(not Path(f"/proc/{pid}").exists() for pid in children)
