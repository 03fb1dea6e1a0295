"""The default deployment as a user runs it — `llm-mesh up`, one engine — driven from a
test: find each service's (or embedded server's) current process, strike it, read its
/metrics, and load the machine beside it with a CPU hog."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from services.common.ports import free_port
from tests.e2e.up_processes import child_running
from tests.faults.streams import poll
from tests.mesh import ENGINE_ARGS, REPO_ROOT, http_get, metric_value

SERVICES = ("gateway", "batch", "tokenizer", "scheduler", "worker", "kvstore")
# The servers `llm-mesh up` embeds, by the short names tests strike them by.
SERVERS = {"nats": "nats-server", "valkey": "valkey-server"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class UpMesh:
    """`llm-mesh up` in a subprocess, logging JSON lines to `log_path`."""

    def __init__(self, log_path: Path, extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log = open(log_path, "wb")
        self.launcher = subprocess.Popen(
            [sys.executable, "-m", "llm_mesh.cli", "up", "--port", str(self.port),
             "--log-format", "json", *ENGINE_ARGS, *(extra_args or [])],
            cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.close()

    def wait_healthy(self, timeout_s: float) -> float:
        def healthy() -> bool:
            assert self.launcher.poll() is None, self.log_tail()
            return http_get(f"{self.base_url}/health")[0] == 200
        return poll(healthy, timeout_s, "the mesh's /health to answer 200", interval_s=0.2)

    def pids(self) -> dict[str, int]:
        """Each service's and embedded server's current pid (a restarted one has a new one)."""
        found = {}
        for name in (*SERVICES, *SERVERS):
            pid = child_running(self.launcher.pid, SERVERS.get(name, name))
            if pid is not None:
                found[name] = pid
        return found

    def pid_of(self, name: str) -> int:
        return self.pids()[name]

    def signal(self, name: str, sig: signal.Signals) -> int:
        pid = self.pid_of(name)
        os.kill(pid, sig)
        return pid

    def health_port(self, service: str) -> int:
        """From the launcher's `started service` line (a restart keeps the port)."""
        for event in self.log_events():
            if event.get("event") == "started service" and event.get("service") == service:
                return int(event["health"].rsplit(":", 1)[1].split("/", 1)[0])
        raise KeyError(f"no `started service` line for {service}")

    def metric(self, service: str, name: str) -> float:
        status, body = http_get(f"http://127.0.0.1:{self.health_port(service)}/metrics")
        if status != 200:
            raise AssertionError(f"{service} /metrics answered {status}")
        try:
            return metric_value(body.decode(), name)
        except KeyError:
            return 0.0

    def log_events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue     # a line another process's output interleaved with
        return events

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        for pid in self.pids().values():   # a stopped child would ignore SIGTERM
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.launcher.send_signal(signal.SIGTERM)
        try:
            return self.launcher.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.launcher.kill()
            return self.launcher.wait()


class CpuHog:
    """Busy processes beside the mesh at the mesh's own priority: a machine also running
    something else, as users' machines are."""

    def __init__(self, num_processes: int) -> None:
        self.processes = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                          for _ in range(num_processes)]

    def stop(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()
