"""Starts a real mesh for tests: nats-server on a random loopback port and every service
as its own process (`python -m services.<name>`), each logging to a file. Services outside
the default set (the batch runner) join a running mesh through `Mesh.add_service`, more
engines through `Mesh.add_engine`. With `with_kvstore`, a valkey-server and a kvstore node
run too and schedulers use them (off by default: most tests need neither)."""

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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from llm_mesh.embedded import EmbeddedNats, EmbeddedRedis
from services.common.ports import free_port
from llm_mesh.service_modules import SERVICE_MODULES

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
    kind: str = ""          # the service it runs, when the name is not one ("worker-1")

    def start(self, env: dict[str, str]) -> None:
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[self.kind or self.name], *self.argv,
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
    with_kvstore: bool = False
    redis: EmbeddedRedis | None = None
    # Torch threads of each worker (0: every core). A mesh of several engines gives each its
    # share, as `llm-mesh up -dp N` does: two workers of two threads on two cores spin in
    # each other's OpenMP barriers, and each step takes several times as long.
    worker_threads: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def start(self, timeout_s: float = 240.0) -> Mesh:
        """Starts NATS (a configured `nats`, or a plain one) and the default services."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.nats = (self.nats or EmbeddedNats()).start()
        self.gateway_port = free_port()
        args = {
            "gateway": ["--port", str(self.gateway_port)],
            "tokenizer": [],
            "scheduler": ENGINE_ARGS[:2],
            "worker": list(ENGINE_ARGS),
        }
        if self.with_kvstore:
            self.redis = (self.redis or EmbeddedRedis()).start()
            args["kvstore"] = ["--redis-url", self.redis.url]
            args["scheduler"] += ["--redis-url", self.redis.url]
        for name, own in args.items():
            self._launch(name, own)
        self.wait_ready(timeout_s)
        return self

    def add_engine(self, engine_id: str, scheduler_args: list[str] | None = None,
                   worker_args: list[str] | None = None, timeout_s: float = 120.0) -> None:
        """Starts another engine (scheduler-<id> and worker-<id>, using the kvstore if the
        mesh has one) and waits until its scheduler is ready and the gateway routes to it."""
        redis = ["--redis-url", self.redis.url] if self.redis is not None else []
        self.add_service(f"worker-{engine_id}", ["--engine-id", engine_id, *ENGINE_ARGS,
                                                 *(worker_args or [])], timeout_s, "worker")
        self.add_service(f"scheduler-{engine_id}", ["--engine-id", engine_id, *ENGINE_ARGS[:2],
                                                    *redis, *(scheduler_args or [])],
                         timeout_s, "scheduler")
        self.wait_gateway_sees_engines(timeout_s)

    def wait_gateway_sees_engines(self, timeout_s: float = 60.0) -> None:
        """Until the gateway counts as many ready schedulers as this mesh runs (a stopped
        one says so as it stops; a new one is known from its first heartbeat)."""
        running = sum(1 for s in self.services.values() if "scheduler" in (s.kind, s.name))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _, body = http_get(f"{self.base_url}/health")
            if body and json.loads(body)["services"].get("scheduler") == f"{running} ready":
                return
            time.sleep(0.1)
        raise TimeoutError(f"the gateway does not see {running} ready engines:\n{self.logs()}")

    def _launch(self, name: str, own_args: list[str], kind: str = "") -> ServiceProcess:
        assert self.nats is not None
        common = ["--nats-url", self.nats.url_for(kind or name), "--namespace", self.namespace]
        if (kind or name) == "worker" and self.worker_threads:
            common += ["--num-threads", str(self.worker_threads)]
        service = ServiceProcess(name, common + own_args + self.extra_args.get(name, []),
                                 self.workdir / f"{name}.log", free_port(), kind=kind)
        service.start({**os.environ, "PYTHONUNBUFFERED": "1"})
        self.services[name] = service
        return service

    def add_service(self, name: str, args: list[str] | None = None,
                    timeout_s: float = 60.0, kind: str = "") -> ServiceProcess:
        """Starts a service the default mesh does not run (e.g. "batch", or a second engine's
        "worker-1" of kind "worker") and waits until its /ready answers 200;
        `remove_service` stops it."""
        service = self._launch(name, list(args or []), kind)
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

    def restart_nats(self) -> None:
        """Stops nats-server and starts it again on the same port (services reconnect)."""
        assert self.nats is not None
        self.nats.restart()

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} ---\n{s.log_tail()}" for s in self.services.values())

    def stop(self) -> dict[str, int]:
        codes = {}
        order = ("gateway", "batch", "tokenizer", "scheduler", "worker", "kvstore")
        for service in sorted(self.services.values(),
                              key=lambda s: (order.index(s.kind or s.name), s.name)):
            codes[service.name] = service.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.redis is not None:
            self.redis.stop()
        return codes

    def scheduler_metric(self, name: str, service: str = "scheduler") -> float:
        """Sum of a metric's samples on a scheduler's /metrics (all label sets)."""
        _, body = self.services[service].get("/metrics")
        return metric_value(body.decode(), name)


@contextmanager
def serving(mesh: Mesh, then: Callable[[Mesh], None] | None = None,
            check_exit: bool = True) -> Iterator[Mesh]:
    """Starts the mesh (and runs `then`, e.g. to add services), printing every service's log
    if that fails; stops it afterwards. With check_exit, every service must have exited
    cleanly (uvicorn re-raises SIGTERM after a clean shutdown: -15; the others exit 0)."""
    try:
        mesh.start()
        if then is not None:
            then(mesh)
    except Exception:
        print(mesh.logs())
        mesh.stop()
        raise
    yield mesh
    codes = mesh.stop()
    if check_exit:
        assert all(code in (0, -15) for code in codes.values()), (codes, mesh.logs())


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
