"""Sleep mode end to end (issue 47), the way an RL trainer uses it: a greedy completion, then
POST /sleep (level 1, then 2) frees the worker process's memory, requests meanwhile get
503 + Retry-After, and POST /wake_up brings back the same greedy output.

One mesh of its own for the module: its worker runs with --enable-sleep-mode, and a small KV
cache whose pages are all faulted in before RSS is read (so the cache's own background
faulting cannot hide what sleep gives back)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest

from services.common.model_files import DEFAULT_MODEL, resolve_model
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get, http_post, serving

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
MAX_TOKENS = 24
KV_CACHE_BYTES = 128 * 1024 * 1024   # 2,900 tokens of SmolLM2: one max_model_len request
KV_PAGES_READY = ("KV cache pages faulted in", "KV cache pages fault in as first written")


@pytest.fixture(scope="module")
def sleepy_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    mesh = Mesh(Path(tmp_path_factory.mktemp("sleep-mesh")), extra_args={
        "worker": ["--enable-sleep-mode", "--kv-cache-memory", str(KV_CACHE_BYTES)]})
    with serving(mesh) as running:
        yield running


def completion(mesh: Mesh, max_tokens: int = MAX_TOKENS) -> tuple[int, dict, Message]:
    """Status, body and headers (case-insensitive) of a greedy completion."""
    request = urllib.request.Request(
        f"{mesh.base_url}/v1/completions", method="POST",
        headers={"Content-Type": "application/json"},
        data=json.dumps({"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                         "temperature": 0}).encode())
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), exc.headers


def greedy_text(mesh: Mesh) -> str:
    status, body, _ = completion(mesh)
    assert status == 200, body
    return body["choices"][0]["text"]


def worker_memory(mesh: Mesh) -> dict[str, int]:
    """The worker process's VmRSS and its parts (RssAnon, RssFile, RssShmem), in bytes."""
    process = mesh.services["worker"].process
    assert process is not None
    status = Path(f"/proc/{process.pid}/status").read_text().splitlines()
    return {key: int(rest.split()[0]) * 1024 for key, _, rest in
            (line.partition(":") for line in status)
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem")}


def mib(memory: dict[str, int]) -> str:
    return ", ".join(f"{key} {value / 2**20:.0f} MiB" for key, value in memory.items())


def weights_bytes() -> int:
    """The dense weights the worker loads (the checkpoint's, not its GGUF blocks beside)."""
    return (resolve_model(DEFAULT_MODEL).hf_dir / "model.safetensors").stat().st_size


def wait_for_kv_pages(mesh: Mesh, timeout_s: float = 120.0) -> None:
    log = mesh.services["worker"].log_path
    poll(lambda: any(line in log.read_text(errors="replace") for line in KV_PAGES_READY),
         timeout_s, "the worker's KV pages to finish faulting in", interval_s=0.2)


def is_sleeping(mesh: Mesh) -> bool:
    status, body = http_get(f"{mesh.base_url}/is_sleeping")
    assert status == 200, body
    return json.loads(body)["is_sleeping"]


def post(mesh: Mesh, path: str) -> None:
    status, body = http_post(f"{mesh.base_url}{path}", b"", timeout=600)
    assert status == 200, (path, body)


def assert_refused_while_asleep(mesh: Mesh) -> None:
    status, body, headers = completion(mesh)
    assert status == 503, body
    assert body["error"]["code"] == "engine_sleeping"
    assert "/wake_up" in body["error"]["message"]
    assert int(headers.get("Retry-After", "0")) > 0


def test_level_1_frees_the_weights_and_wake_up_restores_the_same_output(
        sleepy_mesh: Mesh) -> None:
    before = greedy_text(sleepy_mesh)
    wait_for_kv_pages(sleepy_mesh)
    awake = worker_memory(sleepy_mesh)

    post(sleepy_mesh, "/sleep?level=1")
    asleep = worker_memory(sleepy_mesh)
    print(f"level 1, weights {weights_bytes() / 2**20:.0f} MiB: awake {mib(awake)}; "
          f"asleep {mib(asleep)}")
    assert awake["VmRSS"] - asleep["VmRSS"] >= weights_bytes()
    assert is_sleeping(sleepy_mesh)
    assert_refused_while_asleep(sleepy_mesh)

    post(sleepy_mesh, "/wake_up")
    assert not is_sleeping(sleepy_mesh)
    assert greedy_text(sleepy_mesh) == before
    print(f"level 1, woken up: {mib(worker_memory(sleepy_mesh))}")


def test_level_2_wakes_up_tag_by_tag_from_the_checkpoint(sleepy_mesh: Mesh) -> None:
    before = greedy_text(sleepy_mesh)
    wait_for_kv_pages(sleepy_mesh)
    awake = worker_memory(sleepy_mesh)

    post(sleepy_mesh, "/sleep?level=2")
    asleep = worker_memory(sleepy_mesh)
    print(f"level 2: awake {mib(awake)}; asleep {mib(asleep)}")
    assert awake["VmRSS"] - asleep["VmRSS"] >= weights_bytes()

    post(sleepy_mesh, "/wake_up?tags=weights")   # a trainer may sync weights before the KV
    assert is_sleeping(sleepy_mesh)
    assert_refused_while_asleep(sleepy_mesh)
    post(sleepy_mesh, "/wake_up?tags=kv_cache")
    assert not is_sleeping(sleepy_mesh)
    assert greedy_text(sleepy_mesh) == before


def test_sleep_lets_the_request_in_flight_finish_first(sleepy_mesh: Mesh) -> None:
    """vLLM's sleep wants no request in flight: ours waits for them (new ones get 503)."""
    results: list[tuple[int, dict, Message]] = []
    long_request = threading.Thread(target=lambda: results.append(completion(sleepy_mesh, 96)))
    long_request.start()
    poll(lambda: sleepy_mesh.scheduler_metric("vllm:num_requests_running") >= 1, 60,
         "the request to start running", interval_s=0.02)
    post(sleepy_mesh, "/sleep?level=1")
    long_request.join(timeout=120)
    [(status, body, _)] = results
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 96
    assert body["choices"][0]["finish_reason"] == "length"
    post(sleepy_mesh, "/wake_up")


def test_sleep_and_wake_up_name_one_engine_and_check_their_arguments(sleepy_mesh: Mesh) -> None:
    status, body = http_post(f"{sleepy_mesh.base_url}/sleep?level=3", b"")
    assert status == 400 and body["error"]["param"] == "level"
    status, body = http_post(f"{sleepy_mesh.base_url}/wake_up?tags=optimizer", b"")
    assert status == 400 and "optimizer" in body["error"]["message"]
    status, body = http_post(f"{sleepy_mesh.base_url}/sleep?engine_id=nope", b"")
    assert status == 404 and body["error"]["code"] == "engine_not_found"
    status, body = http_get(f"{sleepy_mesh.base_url}/is_sleeping?engine_id=engine-0")
    assert status == 200 and json.loads(body) == {"is_sleeping": False,
                                                  "engines": {"engine-0": False}}
