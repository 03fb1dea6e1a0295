"""`llm-mesh up` supervises everything it starts: an embedded nats-server or valkey-server
that dies comes back on its port, and a child that hangs (SIGSTOP) is found by its liveness
probe, killed and restarted; the mesh serves again each time. The probes themselves are
tested first, against real servers, without the mesh."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from llm_mesh.embedded import EmbeddedNats, EmbeddedRedis, wait_for_port
from services.common.ports import free_port
from llm_mesh.liveness import (
    PROBE_INTERVAL_S,
    Liveness,
    http_probe,
    is_stopped,
    nats_probe,
    redis_probe,
)
from tests.e2e.up_processes import argv_of, child_running, children_of, launcher_events
from tests.faults.streams import poll
from tests.mesh import ENGINE_ARGS, REPO_ROOT, http_get, http_post

LIVENESS_TIMEOUT_S = 4.0
# A service's health server that never becomes ready, as a worker loading its model: its
# /ready answers 503, its /health 200.
NEVER_READY_SERVICE = """
import asyncio, sys
from prometheus_client import CollectorRegistry
from services.common.health import HealthServer

async def main() -> None:
    await HealthServer("127.0.0.1", int(sys.argv[1]), lambda: (False, "loading"),
                       CollectorRegistry()).start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


def stop(process: subprocess.Popen) -> None:
    """SIGSTOPs a process and waits until every thread of it has stopped (kill() returns
    before they all have: one may still answer a probe meanwhile)."""
    process.send_signal(signal.SIGSTOP)
    poll(lambda: all(is_stopped(int(task.name))
                     for task in Path(f"/proc/{process.pid}/task").iterdir()),
         5, f"pid {process.pid} to stop")


def stays_alive(liveness: Liveness, window_s: float) -> None:
    """Asserts no hang verdict over a whole window (the absence of an event needs one)."""
    end = time.monotonic() + window_s
    while time.monotonic() < end:
        assert liveness.silent_s() is None
        time.sleep(0.05)


def test_server_probes_tell_a_live_server_from_a_stopped_one() -> None:
    with EmbeddedNats() as nats, EmbeddedRedis(password="s3cret") as redis:
        for probe, process in ((nats_probe(nats.host, nats.port), nats.process),
                               (redis_probe(redis.host, redis.port), redis.process)):
            assert process is not None and probe(2.0)   # valkey: -NOAUTH is an answer too
            stop(process)
            try:
                assert not probe(0.5)
            finally:
                process.send_signal(signal.SIGCONT)
            assert probe(2.0)
    assert not nats_probe("127.0.0.1", free_port())(0.5)     # nothing listens


def test_a_live_but_unready_service_is_not_hung_until_it_stops() -> None:
    port = free_port()
    service = subprocess.Popen([sys.executable, "-c", NEVER_READY_SERVICE, str(port)],
                               cwd=REPO_ROOT)
    try:
        wait_for_port("127.0.0.1", port, 30, service, "health server")
        assert http_get(f"http://127.0.0.1:{port}/ready")[0] == 503
        with ThreadPoolExecutor(2) as pool:
            # No start-up grace beyond the timeout: only its answers keep it alive.
            liveness = Liveness(http_probe("127.0.0.1", port), pool, timeout_s=1.5,
                                grace_s=0)
            liveness.restarted(service.pid)
            stays_alive(liveness, 4.0)
            stop(service)
            stopped = time.monotonic()
            poll(lambda: liveness.silent_s() is not None, 5, "the stopped server to be hung")
            # Not at once: its last answer came at most a probe interval before the stop.
            assert time.monotonic() - stopped >= 1.5 - PROBE_INTERVAL_S - 0.1
            assert liveness.silent_s() >= 1.5
    finally:
        service.kill()
        service.wait()


def test_a_child_that_never_answered_is_hung_only_once_stopped() -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        with ThreadPoolExecutor(2) as pool:
            liveness = Liveness(http_probe("127.0.0.1", free_port()), pool, timeout_s=0.5,
                                grace_s=60)
            liveness.restarted(child.pid)
            stays_alive(liveness, 1.5)     # silent past the timeout, but still starting up
            stop(child)
            poll(lambda: liveness.silent_s() is not None, 2, "the stopped child to be hung")
    finally:
        child.kill()
        child.wait()


@dataclass
class Up:
    launcher: subprocess.Popen
    base_url: str
    log_path: Path

    def is_healthy(self) -> bool:
        assert self.launcher.poll() is None, self.log_tail()
        return http_get(f"{self.base_url}/health", timeout=2.0)[0] == 200

    def completes(self) -> bool:
        try:
            status, _ = http_post(f"{self.base_url}/v1/completions",
                                  {"model": "SmolLM2-135M-Instruct", "prompt": "Hello",
                                   "max_tokens": 4, "temperature": 0}, timeout=30)
        except OSError:
            return False
        return status == 200

    def pid_of(self, name: str) -> int | None:
        return child_running(self.launcher.pid, name)

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("up") / "up.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "llm_mesh.cli", "up", "--port", str(port), "--log-format",
             "json", "--liveness-timeout-s", str(LIVENESS_TIMEOUT_S), *ENGINE_ARGS],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    mesh = Up(launcher, f"http://127.0.0.1:{port}", log_path)
    try:
        poll(mesh.is_healthy, 300, "the mesh's /health to answer 200", interval_s=0.2)
        yield mesh
    finally:
        for pid in children_of(launcher.pid):   # a failed test may leave one stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    assert code == 0, mesh.log_tail()


@dataclass
class Strike:
    old_pid: int
    replaced_after_s: float    # from the signal to the new process


def strike(up: Up, name: str, sig: signal.Signals, replaced_within_s: float) -> Strike:
    """Signals `name`'s process; waits for the launcher to replace it, then for the mesh to
    serve again."""
    poll(up.is_healthy, 180, "the mesh to be healthy before the strike", interval_s=0.2)
    old = up.pid_of(name)
    assert old is not None, f"no {name} under the launcher"
    argv, policy = argv_of(old), os.sched_getscheduler(old)
    os.kill(old, sig)
    replaced_after_s = poll(lambda: up.pid_of(name) not in (None, old), replaced_within_s,
                            f"the launcher to replace {name} (pid {old})", interval_s=0.1)
    new = up.pid_of(name)
    assert new is not None
    # The same port (and NATS's store). valkey-server retitles itself once it listens, so
    # its command line settles to the old one's only then.
    poll(lambda: argv_of(new) == argv, 15, f"{name} (pid {new}) to run as the old one did")
    assert os.sched_getscheduler(new) == policy   # a service comes back at SCHED_IDLE too
    assert not Path(f"/proc/{old}").exists()          # reaped, not left stopped
    poll(up.is_healthy, 180, f"/health to answer 200 after {name} came back", interval_s=0.2)
    poll(up.completes, 120, "a completion to succeed", interval_s=0.5)
    return Strike(old, replaced_after_s)


def restart_logged(up: Up, name: str, code: int) -> bool:
    return any(e["service"] == name and e["code"] == code
               for e in launcher_events(up.log_path, "service exited; restarting it"))


@pytest.mark.slow
@pytest.mark.parametrize("server", ["nats-server", "valkey-server"])
def test_a_killed_embedded_server_comes_back_on_its_port(up: Up, server: str) -> None:
    strike(up, server, signal.SIGKILL, replaced_within_s=15)
    assert restart_logged(up, server, -signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tokenizer", "nats-server"])
def test_a_stopped_child_is_killed_and_restarted(up: Up, name: str) -> None:
    struck = strike(up, name, signal.SIGSTOP, replaced_within_s=LIVENESS_TIMEOUT_S + 20)
    hung = [e for e in launcher_events(up.log_path, "service hung; killing it")
            if e["pid"] == struck.old_pid]
    assert len(hung) == 1 and hung[0]["service"] == name, up.log_tail()
    assert hung[0]["silent_s"] >= LIVENESS_TIMEOUT_S
    # Not before its timeout: its last answer came at most a probe interval before the stop.
    assert struck.replaced_after_s >= LIVENESS_TIMEOUT_S - PROBE_INTERVAL_S - 0.5
    assert restart_logged(up, name, -signal.SIGKILL)
