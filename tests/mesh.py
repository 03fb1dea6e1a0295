"""Starts a real mesh for tests: nats-server on a random loopback port and every service
as its own process (`python -m services.<name>`), each logging to a file. Services outside
the default set (the batch runner) join a running mesh through `Mesh.add_service`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from llm_mesh.cli import SERVICE_MODULES
from llm_mesh.embedded import EmbeddedNats, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]

# Small enough for 2-core CI machines; big enough for every e2e test.
ENGINE_ARGS = ["--max-model-len", "2048", "--kv-cache-memory", str(512 * 1024 * 1024)]


@dataclass
class ServiceProcess:
    name: str
    argv: list[str]
    log_path: Path
    health_port: int
    process: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[self.name], *self.argv,
             "--health-port", str(self.health_port), "--log-format", "json"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        log.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"{self.name} did not stop within {timeout_s} s")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def get(self, path: str) -> tuple[int, bytes]:
        return http_get(f"http://127.0.0.1:{self.health_port}{path}")


@dataclass
class Mesh:
    workdir: Path
    extra_args: dict[str, list[str]] = field(default_factory=dict)
    namespace: str = "test"
    nats: EmbeddedNats | None = None
    services: dict[str, ServiceProcess] = field(default_factory=dict)
    gateway_port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self, timeout_s: float = 240.0) -> Mesh:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nats = EmbeddedNats().start()
        self.gateway_port = free_port()
        args = {
            "gateway": ["--port", str(self.gateway_port)],
            "tokenizer": [],
            "scheduler": ENGINE_ARGS[:2],
            "worker": list(ENGINE_ARGS),
        }
        for name, own in args.items():
            self._launch(name, own)
        self.wait_ready(timeout_s)
        return self

    def _launch(self, name: str, own_args: list[str]) -> ServiceProcess:
        assert self.nats is not None
        common = ["--nats-url", self.nats.url, "--namespace", self.namespace]
        service = ServiceProcess(name, common + own_args + self.extra_args.get(name, []),
                                 self.workdir / f"{name}.log", free_port())
        service.start({**os.environ, "PYTHONUNBUFFERED": "1"})
        self.services[name] = service
        return service

    def add_service(self, name: str, args: list[str] | None = None,
                    timeout_s: float = 60.0) -> ServiceProcess:
        """Starts a service the default mesh does not run (e.g. "batch") and waits until its
        /ready answers 200; `remove_service` stops it."""
        service = self._launch(name, list(args or []))
        deadline = time.monotonic() + timeout_s
        while service.get("/ready")[0] != 200:
            if service.process is not None and service.process.poll() is not None:
                raise RuntimeError(f"{name} exited during start-up:\n{service.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not become ready:\n{service.log_tail()}")
            time.sleep(0.1)
        return service

    def remove_service(self, name: str) -> int:
        return self.services.pop(name).stop()

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for service in self.services.values():
                if service.process is not None and service.process.poll() is not None:
                    raise RuntimeError(f"{service.name} exited during start-up:\n"
                                       f"{service.log_tail()}")
            status, _ = http_get(f"{self.base_url}/health")
            if status == 200:
                return
            time.sleep(0.2)
        raise TimeoutError("the mesh did not become ready:\n" + self.logs())

    def restart(self, name: str, sig: int = signal.SIGKILL) -> None:
        service = self.services[name]
        service.stop(sig)
        service.start({**os.environ, "PYTHONUNBUFFERED": "1"})

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.services.values())

    def stop(self) -> dict[str, int]:
        codes = {}
        for name in ("gateway", "batch", "tokenizer", "scheduler", "worker"):
            if name in self.services:
                codes[name] = self.services[name].stop()
        if self.nats is not None:
            self.nats.stop()
        return codes

    def scheduler_metric(self, name: str) -> float:
        """Sum of a metric's samples on the scheduler's /metrics (all label sets)."""
        _, body = self.services["scheduler"].get("/metrics")
        return metric_value(body.decode(), name)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of metric `name` whose labels include `labels`."""
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, value = line.rsplit(" ", 1)
        sample, _, label_text = head.partition("{")
        if sample != name:
            continue
        have = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', label_text))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"metric {name} {labels or ''} not exported")
    return total


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except OSError:
        return 0, b""


def http_post(url: str, body: dict | bytes, headers: dict[str, str] | None = None,
              timeout: float = 60.0) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, json.loads(raw) if raw else {}
