"""`llm-mesh up`: the whole mesh on one machine, one process per service.

Starts an embedded nats-server unless --nats-url names one, and (with the KV connector on,
the default) an embedded Redis-protocol server unless --redis-url names one; prepares the
model once (a GGUF is converted on first use), starts tokenizer, gateway, the batch runner,
a kvstore node and one or more engines (--data-parallel-size scheduler + worker pairs,
llm_mesh/engines.py) as child processes, and supervises them all: a child that
exits is restarted (an embedded server on its port, NATS with its JetStream store), one that
stops answering its liveness probe (llm_mesh/liveness.py) is killed first. On Ctrl-C /
SIGTERM it stops them all, gateway first, leaving no process behind.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import structlog

from llm_mesh.embedded import EmbeddedNats, EmbeddedRedis
from llm_mesh.engines import ENGINE_SERVICES, EnginePlan, plan_engines
from llm_mesh.liveness import Liveness, Probe, http_probe, nats_probe, redis_probe
from llm_mesh.service_modules import SERVICE_MODULES
from services.batch.settings import BatchSettings
from services.common.logs import configure_logging
from services.common.ports import free_ports, reserve_ports
from services.common.model_files import resolve_model
from services.common.settings import (
    add_arguments,
    build_settings,
    env_name,
    flag_name,
    setting,
)
from services.gateway.settings import GatewaySettings
from services.kvstore.settings import KVStoreSettings
from services.scheduler.settings import SchedulerSettings
from services.tokenizer.settings import TokenizerSettings
from services.worker.settings import WorkerSettings

log = structlog.get_logger("llm-mesh")

# Order matters for shutdown: the gateway and the batch runner stop first so no new work
# comes in while the rest drain; the kvstore last, after the workers' saves.
SERVICES: dict[str, type] = {
    "gateway": GatewaySettings,
    "batch": BatchSettings,
    "tokenizer": TokenizerSettings,
    "scheduler": SchedulerSettings,
    "worker": WorkerSettings,
    "kvstore": KVStoreSettings,
}
# Set per child by the launcher, never passed through from the command line.
_MANAGED = {"nats_url", "health_port", "instance_id"}
_MAX_RESTARTS_PER_MINUTE = 5


@dataclass
class UpSettings:
    nats_url: str = setting("", "Use this NATS server instead of starting one", secret=True)
    redis_url: str = setting("", "Use this Redis for the kvstore's index and the rate limits' "
                             "buckets instead of starting one "
                             "(redis://:password@host:port/0)", secret=True)
    startup_timeout_s: float = setting(600.0, "Longest to wait for the mesh to be ready")
    liveness_timeout_s: float = setting(
        10.0, "Seconds a service or embedded server may leave its liveness probe (/health, "
        "NATS INFO, Redis PING; one a second) unanswered before it counts as hung (SIGSTOP, "
        "a deadlock) and is killed and restarted like a crash; one not answered yet since "
        "its start gets --startup-timeout-s unless it is stopped. 0: off")
    services_sched_idle: bool = setting(
        True, "Run every service but the worker under Linux's SCHED_IDLE policy: their "
        "per-token work then never preempts the worker's threads when it wakes (a thread "
        "preempted mid-step stalls its partner at the next barrier; docs/benchmarks.md "
        "10l, 10m). Off, or where the OS has no SCHED_IDLE: --services-nice")
    services_nice: int = setting(
        10, "Niceness of every service but the worker where SCHED_IDLE is off or missing "
        "(0-19; 0: as the launcher)")
    data_parallel_size: int = setting(
        1, "Engines to start (scheduler + worker pairs engine-0 ... engine-{N-1}; the "
        "gateway spreads requests over them). Each worker gets an equal share of the cores "
        "unless --num-threads is given, and of the memory its KV cache takes by default "
        "(--kv-cache-memory-fraction, --gpu-memory-utilization); --kv-cache-memory is per "
        "engine")


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-mesh up", description="Start the whole mesh on this machine: NATS, Redis, "
        "tokenizer, scheduler, worker, the OpenAI-compatible gateway, the batch runner and a "
        "kvstore node.")
    # vLLM's short form too, which add_arguments cannot give.
    [dp] = [f for f in dataclasses.fields(UpSettings) if f.name == "data_parallel_size"]
    parser.add_argument("--data-parallel-size", "-dp", dest=dp.name, type=int, metavar="N",
                        default=argparse.SUPPRESS, help=dp.metadata["help"])
    seen = set(_MANAGED - {"nats_url"}) | {dp.name}
    add_arguments(parser, UpSettings, seen)
    for cls in SERVICES.values():
        add_arguments(parser, cls, seen)
    return parser


def service_argv(service: str, explicit: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The flags the user gave that `service` declares, and its secrets (API keys, URLs with
    credentials) as LLM_MESH_* variables instead: a command line is visible to every local
    user (ps), a process's environment only to its owner."""
    fields = {f.name: f for f in dataclasses.fields(SERVICES[service]) if f.name not in _MANAGED}
    argv: list[str] = []
    env: dict[str, str] = {}
    for name, value in explicit.items():
        if name not in fields:
            continue
        if fields[name].metadata.get("secret"):
            env[env_name(name)] = ",".join(value) if isinstance(value, list) else str(value)
        elif isinstance(value, bool):
            argv.append(flag_name(name) if value else "--no-" + flag_name(name)[2:])
        elif isinstance(value, list):
            for item in value:
                argv += [flag_name(name), str(item)]
        else:
            argv += [flag_name(name), str(value)]
    return argv, env


@dataclass
class Child:
    """A process the launcher keeps running, a service or an embedded server: started again
    when it exits, killed first when its liveness probe finds it hung."""
    name: str
    launch: Callable[[], subprocess.Popen]
    liveness: Liveness | None = None        # None: --liveness-timeout-s 0
    process: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)
    engine: str = ""                        # a scheduler's or worker's engine id

    @property
    def log_fields(self) -> dict[str, str]:
        """How log lines name this child: its service, and a scheduler's or worker's engine."""
        return {"service": self.name, **({"engine": self.engine} if self.engine else {})}

    def start(self) -> None:
        self.process = self.launch()
        if self.liveness is not None:
            self.liveness.restarted(self.process.pid)

    def exited(self) -> int | None:
        return None if self.process is None else self.process.poll()


@dataclass(frozen=True)
class Priority:
    """How a service shares the CPU with the worker."""

    sched_idle: bool = False
    nice: int = 0   # added to the launcher's, where SCHED_IDLE is off or missing

    @property
    def log_fields(self) -> dict[str, Any]:
        return {"sched_idle": True} if self.sched_idle else {"nice": self.nice}


def _launch_service(name: str, argv: list[str], health_port: int, env: dict[str, str],
                    priority: Priority) -> subprocess.Popen:
    """`env`: the secrets, as LLM_MESH_* variables."""
    # NOTE: each service gets a session of its own, so where the kernel groups sessions
    # (autogroup) its SCHED_IDLE ranks it only within that group; in the launcher's session
    # the streams starved (ITL P99 5-7x, docs/benchmarks.md 10m).
    return subprocess.Popen(
        [sys.executable, "-m", SERVICE_MODULES[name], *argv, "--health-port", str(health_port)],
        env={**os.environ, **env}, start_new_session=True,
        preexec_fn=partial(_prepare_child, priority))


def _launch_server(server: EmbeddedNats | EmbeddedRedis) -> subprocess.Popen:
    """(Re)starts an embedded server on its port; NATS keeps its JetStream store."""
    process = server.start().process
    assert process is not None
    return process


def _libc_prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:   # not glibc Linux: children outlive a killed launcher
        return None


# NOTE: looked up here, not in the forked child: dlopen there could deadlock on the loader's
# lock if a liveness probe thread held it at the fork.
_PRCTL = _libc_prctl()


def _prepare_child(priority: Priority) -> None:
    """In the child before it runs: SIGTERM if the launcher itself is killed (Linux
    PR_SET_PDEATHSIG), and its priority (inherited by every thread it starts)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)
    if priority.sched_idle:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return
        except OSError:   # a sandbox refusing the policy must not stop the service starting
            pass
    if priority.nice:
        os.nice(priority.nice)


class Mesh:
    def __init__(self, explicit: dict[str, Any]) -> None:
        self.explicit = explicit
        self.up = UpSettings(**{k: v for k, v in explicit.items()
                                if k in {f.name for f in dataclasses.fields(UpSettings)}})
        self.nats: EmbeddedNats | None = None
        self.redis: EmbeddedRedis | None = None
        self.servers: list[Child] = []      # the embedded servers, stopped last
        self.children: list[Child] = []     # the services, in SERVICES order
        # NOTE: a probe waits on the network; two threads per child keep a late one (and
        # one still out for a killed process) from delaying the next child's.
        num_children = len(SERVICES) + len(ENGINE_SERVICES) * (self.up.data_parallel_size - 1)
        self._probe_pool = ThreadPoolExecutor(2 * (num_children + 2),
                                              thread_name_prefix="liveness")
        self._stopping = False

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self._start()
            if not self._wait_until_ready():
                return 1
            self._supervise()
            return 0
        finally:
            self.stop()

    def _on_signal(self, signum: int, _frame: object) -> None:
        if not self._stopping:
            log.info("stopping the mesh", signal=signal.Signals(signum).name)
        self._stopping = True

    def _child(self, name: str, launch: Callable[[], subprocess.Popen], probe: Probe,
               engine: str = "") -> Child:
        liveness = None
        if self.up.liveness_timeout_s > 0:
            liveness = Liveness(probe, self._probe_pool, self.up.liveness_timeout_s,
                                grace_s=self.up.startup_timeout_s)
        child = Child(name, launch, liveness, engine=engine)
        child.start()
        return child

    def _start(self) -> None:
        # Ports the user set (the gateway's --port, ...) are not drawn for the embedded servers.
        reserve_ports(value for key, value in self.explicit.items()
                      if key.endswith("port") and isinstance(value, int))
        nats_url = self.up.nats_url
        if not nats_url:
            self.nats = EmbeddedNats()
            self.servers.append(self._child("nats-server", partial(_launch_server, self.nats),
                                            nats_probe(self.nats.host, self.nats.port)))
            nats_url = self.nats.url
            log.info("embedded NATS started", url=nats_url)
        redis_env = self._start_redis()
        health_host = _loopback(self.explicit.get("health_host", "127.0.0.1"))
        # Convert the model once here, so the services don't race to do it.
        files = resolve_model(self.explicit.get("model", ""))
        log.info("model ready", model=files.served_name, files=str(files.hf_dir))
        engines = self._plan_engines()
        services = [(name, engine) for name in SERVICES
                    if name != "kvstore" or self.explicit.get("enable_kv_connector", True)
                    for engine in (engines if name in ENGINE_SERVICES else [None])]
        # NOTE: the kvstore's gRPC port is picked with the health ports: a port the OS handed
        # it (0: any) could be one picked here for a service that has not bound it yet.
        *ports, grpc_port = free_ports(len(services) + 1)
        for (name, engine), port in zip(services, ports, strict=True):
            settings = self.explicit if engine is None else {**self.explicit,
                                                             **engine.overrides}
            if name == "kvstore" and not settings.get("grpc_port"):
                settings = {**settings, "grpc_port": grpc_port}
            argv, env = service_argv(name, settings)
            env[env_name("nats_url")] = nats_url
            if "redis_url" in {f.name for f in dataclasses.fields(SERVICES[name])}:
                env.update(redis_env)
            priority = Priority() if name == "worker" else self._services_priority
            child = self._child(name, partial(_launch_service, name, argv, port, env, priority),
                                http_probe(health_host, port),
                                engine.engine_id if engine is not None else "")
            self.children.append(child)
            log.info("started service", **child.log_fields, pid=child.process.pid,
                     **priority.log_fields, health=f"http://{health_host}:{port}/ready")

    @property
    def _services_priority(self) -> Priority:
        """Every service's but the worker's: SCHED_IDLE where asked for and the OS has it."""
        return Priority(sched_idle=self.up.services_sched_idle and hasattr(os, "SCHED_IDLE"),
                        nice=self.up.services_nice)

    def _plan_engines(self) -> list[EnginePlan]:
        """The --data-parallel-size engines, splitting the cores we may run on (what a
        worker would take by default) among them."""
        worker = build_settings(WorkerSettings, self.explicit)
        cores = len(os.sched_getaffinity(0))
        engines = plan_engines(worker, self.up.data_parallel_size, cores,
                               self.explicit.get("enable_kv_events"))
        shared = {k: v for k, v in engines[0].overrides.items() if k != "engine_id"}
        log.info("starting engines", engines=len(engines), cores=cores,
                 engine_ids=[e.engine_id for e in engines],
                 threads_per_engine=shared.pop("num_threads"),
                 kv_cache_memory=worker.kv_cache_memory, **shared)
        return engines

    def _start_redis(self) -> dict[str, str]:
        """The Redis URL for the services that use it: an embedded server unless the user
        named one (their flag already reaches those services) or turned the KV connector
        off."""
        if self.up.redis_url or not self.explicit.get("enable_kv_connector", True):
            return {}
        self.redis = EmbeddedRedis()
        self.servers.append(self._child("valkey-server", partial(_launch_server, self.redis),
                                        redis_probe(self.redis.host, self.redis.port)))
        log.info("embedded Redis started", url=self.redis.url)
        return {env_name("redis_url"): self.redis.url}

    def _gateway_url(self) -> str:
        host = _loopback(self.explicit.get("host", GatewaySettings.host))
        return f"http://{host}:{self.explicit.get('port', GatewaySettings.port)}"

    def _wait_until_ready(self) -> bool:
        deadline = time.monotonic() + self.up.startup_timeout_s
        last_detail = None
        while not self._stopping and time.monotonic() < deadline:
            for child in self.children:
                if child.exited() is not None:
                    log.error("service exited during start-up; see its log above",
                              **child.log_fields, code=child.exited())
                    return False
            ok, services = _mesh_health(self._gateway_url())
            # Every engine, not only the first the gateway would already serve with, and
            # every other service started here: /health does not wait for a kvstore or a
            # batch runner it has not heard from yet.
            engines = min(_ready_count(services.get(name, "")) for name in ENGINE_SERVICES)
            others = {child.name for child in self.children} - {"gateway", *ENGINE_SERVICES}
            if ok and engines >= self.up.data_parallel_size \
                    and all(_ready_count(services.get(name, "")) for name in others):
                url = self._gateway_url()
                log.info("mesh ready", api=f"{url}/v1", health=f"{url}/health",
                         try_it=f"curl {url}/v1/chat/completions -H 'Content-Type: "
                                f"application/json' -d '{{\"model\": \"{_model_name(self.explicit)}\", "
                                f"\"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'",
                         engines=engines)
                return True
            detail = ", ".join(f"{k}: {v}" for k, v in services.items())
            if detail != last_detail and detail:
                log.info("waiting for the mesh", services=detail)
                last_detail = detail
            time.sleep(0.25)
        if not self._stopping:
            log.error("the mesh did not become ready in time",
                      timeout_s=self.up.startup_timeout_s)
        return False

    def _supervise(self) -> None:
        while not self._stopping:
            for child in [*self.servers, *self.children]:
                if self._stopping:
                    break
                _kill_if_hung(child)
                code = child.exited()
                if code is not None:
                    self._restart(child, code)
            time.sleep(0.2)

    def _restart(self, child: Child, code: int) -> None:
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < 60] + [now]
        if len(child.restarts) > _MAX_RESTARTS_PER_MINUTE:
            log.error("service keeps crashing; stopping the mesh", **child.log_fields)
            self._stopping = True
            return
        log.warning("service exited; restarting it", **child.log_fields, code=code)
        try:
            child.start()
        except RuntimeError as exc:   # an embedded server exited at once: the next pass retries
            log.error("service did not restart", **child.log_fields, error=str(exc))

    def stop(self) -> None:
        self._stopping = True
        for child in self.children:  # gateway first: no new work while the rest drain
            _terminate(child)
        for child in self.children:
            _reap(child)
        self._probe_pool.shutdown(wait=False, cancel_futures=True)
        if self.nats is not None:
            self.nats.stop()
        if self.redis is not None:
            self.redis.stop()
        log.info("mesh stopped")


def _kill_if_hung(child: Child) -> None:
    """SIGKILLs a child its liveness probe finds hung; the supervisor then restarts it."""
    silent_s = child.liveness.silent_s() if child.liveness is not None else None
    if silent_s is None or child.process is None or child.process.poll() is not None:
        return
    log.warning("service hung; killing it", **child.log_fields, pid=child.process.pid,
                silent_s=round(silent_s, 1))
    child.process.kill()
    child.process.wait()


def _terminate(child: Child) -> None:
    if child.process is not None and child.process.poll() is None:
        child.process.send_signal(signal.SIGTERM)
        child.process.send_signal(signal.SIGCONT)   # a stopped child acts on it only then


def _reap(child: Child, timeout_s: float = 40.0) -> None:
    if child.process is None:
        return
    try:
        child.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log.warning("service did not stop in time; killing it", **child.log_fields)
        child.process.kill()
        child.process.wait()


def _loopback(host: str) -> str:
    """Where this machine reaches a server bound to `host` (0.0.0.0: any address)."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def _mesh_health(base_url: str) -> tuple[bool, dict[str, str]]:
    """Whether the gateway's /health answers 200, and what it says of each kind of service
    ("scheduler": "2 ready")."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200, _health_services(response.read())
    except urllib.error.HTTPError as exc:
        return False, _health_services(exc.read())
    except OSError:
        return False, {"gateway": "starting"}


def _health_services(body: bytes) -> dict[str, str]:
    try:
        services = json.loads(body).get("services", {})
    except (ValueError, AttributeError):
        return {}
    return services if isinstance(services, dict) else {}


def _ready_count(detail: str) -> int:
    """How many of a kind of service /health calls ready ("2 ready": 2; else 0)."""
    count, _, rest = detail.partition(" ")
    return int(count) if count.isdigit() and rest == "ready" else 0


def _model_name(explicit: dict[str, Any]) -> str:
    if explicit.get("served_model_name"):
        return explicit["served_model_name"]
    return resolve_model(explicit.get("model", "")).served_name


def main(argv: Sequence[str]) -> int:
    parser = up_parser()
    explicit = vars(parser.parse_args(argv))
    if not 0 <= explicit.get("services_nice", 0) <= 19:
        parser.error("--services-nice must be 0-19 (a lower niceness needs privileges)")
    if explicit.get("data_parallel_size", 1) < 1:
        parser.error("--data-parallel-size must be at least 1")
    configure_logging("llm-mesh", "launcher", explicit.get("log_level", "info"),
                      explicit.get("log_format", "auto"))
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return Mesh(explicit).run()
