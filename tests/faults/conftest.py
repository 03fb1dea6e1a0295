"""One mesh for every fault test: NATS, a gateway, a tokenizer and two engines
(engine-0: `scheduler` + `worker`; engine-1: `scheduler-1` + `worker-1`). Each test breaks
something, checks what clients saw, and leaves the mesh whole again (the restarted service
rejoined, everything ready), so the next test starts from a healthy mesh."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.faults.streams import poll
from tests.mesh import ENGINE_ARGS, Mesh, http_get, http_post, metric_value, serving

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The history of the printing press", "A recipe for bread begins with",
           "The planets of the solar system are", "def quicksort(items):"]
MAX_TOKENS = 40
ENGINE_1 = ["--engine-id", "engine-1"]
# The gateway's bounds (its defaults): a stream ends within STALL + MIGRATION (+ a second
# or two) of its last progress, whatever hangs. The stall timeout must stay above a worker's
# restart (~10-15 s on a loaded 2-core machine), or the watchdog, not the scheduler's
# rejoin path, would resume a killed worker's requests (tests/faults/test_faults.py).
STALL_TIMEOUT_S = 30.0
MIGRATION_TIMEOUT_S = 30.0
GATEWAY_ARGS = ["--migration-timeout-s", str(MIGRATION_TIMEOUT_S),
                "--stall-timeout-s", str(STALL_TIMEOUT_S), "--sse-keepalive-s", "1"]
# Fault tests print what clients saw and how long recovery took; collected here.
REPORT: list[dict[str, Any]] = []


@pytest.fixture(scope="package")
def fault_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    def add_engine_1(mesh: Mesh) -> None:
        mesh.add_service("worker-1", [*ENGINE_ARGS, *ENGINE_1], kind="worker", timeout_s=120)
        mesh.add_service("scheduler-1", [*ENGINE_ARGS[:2], *ENGINE_1], kind="scheduler")
        wait_whole(mesh)

    try:
        with serving(Mesh(Path(tmp_path_factory.mktemp("faults")), namespace="faults",
                          extra_args={"gateway": GATEWAY_ARGS}, worker_threads=1),
                     add_engine_1) as mesh:
            yield mesh
    finally:
        if REPORT:
            print("\n" + "\n".join(json.dumps(entry) for entry in REPORT))


@pytest.fixture(autouse=True)
def whole_mesh_after_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that fails halfway may leave a service killed or frozen; the tests after it
    share the mesh, so it is made whole here rather than failing them too."""
    yield
    if "fault_mesh" not in request.fixturenames:
        return
    mesh: Mesh = request.getfixturevalue("fault_mesh")
    for name, service in mesh.services.items():
        assert service.process is not None   # every service of a running mesh was started
        if service.process.poll() is None:
            service.process.send_signal(signal.SIGCONT)
        else:
            mesh.restart(name)   # it exited: reaped, then started again
    wait_whole(mesh)


@pytest.fixture(scope="package")
def reference(fault_mesh: Mesh) -> list[str]:
    """Each prompt's greedy text on the undisturbed mesh."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(lambda prompt: complete(fault_mesh, prompt)["choices"][0]["text"],
                             PROMPTS))


def bodies(max_tokens: int = MAX_TOKENS) -> list[dict[str, Any]]:
    return [completion_body(prompt, max_tokens) for prompt in PROMPTS]


def completion_body(prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}


def complete(mesh: Mesh, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    status, body = http_post(f"{mesh.base_url}/v1/completions",
                             completion_body(prompt, max_tokens), timeout=120)
    assert status == 200, body
    return body


def health(mesh: Mesh) -> dict[str, str]:
    status, body = http_get(f"{mesh.base_url}/health")
    return json.loads(body)["services"] if body else {}


def wait_whole(mesh: Mesh, timeout_s: float = 120.0) -> float:
    """Waits until the gateway sees both engines and the tokenizer ready, and every
    service's own /ready answers 200; returns the seconds it took."""
    def whole() -> bool:
        detail = health(mesh)
        return (detail.get("scheduler") == "2 ready" and detail.get("worker") == "2 ready"
                and detail.get("tokenizer") == "1 ready"
                and all(s.get("/ready")[0] == 200 for s in mesh.services.values()))
    return poll(whole, timeout_s, "the whole mesh to be ready", interval_s=0.2)


def metric(mesh: Mesh, service: str, name: str, **labels: str) -> float:
    _, body = mesh.services[service].get("/metrics")
    try:
        return metric_value(body.decode(), name, **labels)
    except KeyError:
        return 0.0


def gateway_metric(mesh: Mesh, name: str, **labels: str) -> float:
    _, body = http_get(f"{mesh.base_url}/metrics")
    try:
        return metric_value(body.decode(), name, **labels)
    except KeyError:
        return 0.0


ENGINES = {"engine-0": ("scheduler", "worker"), "engine-1": ("scheduler-1", "worker-1")}


def busiest_engine(mesh: Mesh) -> tuple[str, str]:
    """(scheduler, worker) of the engine holding the most requests now: the gateway places
    requests by load, so a test finds where its streams landed instead of assuming."""
    def load(engine: str) -> float:
        scheduler = ENGINES[engine][0]
        return (metric(mesh, scheduler, "vllm:num_requests_running")
                + metric(mesh, scheduler, "vllm:num_requests_waiting"))
    return ENGINES[max(sorted(ENGINES), key=load)]


ENGINE_LOAD = ("vllm:num_requests_running", "vllm:num_requests_waiting",
               "vllm:kv_cache_usage_perc")


def engine_load(mesh: Mesh) -> dict[str, list[float]]:
    """Each scheduler's running and waiting requests and KV cache usage."""
    return {name: [metric(mesh, name, gauge) for gauge in ENGINE_LOAD]
            for name in ("scheduler", "scheduler-1")}


def engines_idle(mesh: Mesh) -> bool:
    return all(value == 0 for load in engine_load(mesh).values() for value in load)


def wait_idle(mesh: Mesh, timeout_s: float, what: str) -> float:
    """Waits for both engines to hold no request and no block; a timeout names their load."""
    return poll(lambda: engines_idle(mesh), timeout_s, what, state=lambda: engine_load(mesh))


def record(fault: str, **facts: Any) -> None:
    entry = {"fault": fault, **{k: round(v, 2) if isinstance(v, float) else v
                                for k, v in facts.items()}}
    REPORT.append(entry)
    print(json.dumps(entry))
