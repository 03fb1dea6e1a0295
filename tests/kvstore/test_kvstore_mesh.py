"""The kvstore in a real mesh (valkey-server, a kvstore node behind a fault proxy, engines):
a long prompt computed and reused on one engine (the default save mode stores it on reuse) is
loaded on another with identical greedy output; a
corrupted block, a slow store and a kvstore killed mid-load end in a recompute within a
bounded time while the engine serves others; a producer + consumer pair serves a request as
one engine would; the node's memory stays within its bound under a soak."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.ports import free_port
from tests.kvstore.conftest import stub_for
from tests.kvstore.fault_proxy import FaultProxy
from tests.kvstore.test_data_plane import put_messages
from tests.faults.streams import poll
from tests.mesh import Mesh, http_get, http_post, metric_value, serving

pytestmark = pytest.mark.slow

LOAD_TIMEOUT_S = 3.0
CPU_BYTES = 160 * 1024 * 1024
BLOCK = 16
SCHEDULER_B = "scheduler-b"


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    running = FaultProxy(upstream_port=free_port()).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def kv_mesh(tmp_path_factory: pytest.TempPathFactory, proxy: FaultProxy) -> Iterator[Mesh]:
    worker_args = ["--kv-load-timeout-s", str(LOAD_TIMEOUT_S)]
    with serving(Mesh(Path(tmp_path_factory.mktemp("kvmesh")), namespace="kvmesh",
                      with_kvstore=True, extra_args={
                          "kvstore": ["--grpc-port", str(proxy.upstream_port),
                                      "--advertise-address", proxy.address,
                                      "--kv-cpu-bytes", str(CPU_BYTES)],
                          "worker": worker_args}, worker_threads=1),
                 check_exit=False) as running:
        yield running


def complete(mesh: Mesh, prompt: list[int], salt: str, max_tokens: int = 12) -> dict:
    status, body = http_post(f"{mesh.base_url}/v1/completions", {
        "model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True, "cache_salt": salt}, timeout=300)
    assert status == 200, body
    return body


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def metric(mesh: Mesh, name: str, service: str = SCHEDULER_B) -> float:
    return mesh.scheduler_metric(name, service)


def wait_until_stored(mesh: Mesh, num_blocks: int, timeout_s: float = 30.0) -> None:
    """Waits until the kvstore has taken `num_blocks` blocks in all (saves are asynchronous:
    they may land after the request that computed them finished)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _, body = mesh.services["kvstore"].get("/metrics")
        if metric_value(body.decode(), "llm_mesh:kvstore_put_blocks_total") >= num_blocks:
            return
        assert time.monotonic() < deadline, "the kvstore did not receive the blocks"
        time.sleep(0.1)


def gateway_metric(mesh: Mesh, name: str, **labels: str) -> float:
    _, body = http_get(f"{mesh.base_url}/metrics")
    return metric_value(body.decode(), name, **labels)


def stored_blocks(mesh: Mesh) -> int:
    _, body = mesh.services["kvstore"].get("/metrics")
    return int(metric_value(body.decode(), "llm_mesh:kvstore_put_blocks_total"))


def reset_prefix_cache(mesh: Mesh) -> None:
    status, body = http_post(f"{mesh.base_url}/reset_prefix_cache", {})
    assert status == 200, body


def test_a_prompt_computed_on_engine_a_is_loaded_on_engine_b(kv_mesh: Mesh) -> None:
    prompt = tokens(2000, seed=1)
    on_a = complete(kv_mesh, prompt, "two-engines")
    assert cached(on_a) == 0
    # Reused on engine A: the default save mode (on_reuse) sends the blocks it hit to the store.
    again = complete(kv_mesh, prompt, "two-engines")
    assert cached(again) == 1999 // BLOCK * BLOCK
    assert again["choices"][0]["text"] == on_a["choices"][0]["text"]
    wait_until_stored(kv_mesh, 1999 // BLOCK)
    kv_mesh.remove_service("scheduler")   # engine A goes away with its prefix cache
    kv_mesh.remove_service("worker")
    kv_mesh.add_engine("b", worker_args=["--kv-load-timeout-s", str(LOAD_TIMEOUT_S)])
    on_b = complete(kv_mesh, prompt, "two-engines")
    assert on_b["choices"][0]["text"] == on_a["choices"][0]["text"]
    assert cached(on_b) == 1999 // BLOCK * BLOCK    # loaded, not recomputed
    assert metric(kv_mesh, "vllm:external_prefix_cache_hits_total") == cached(on_b)
    assert metric(kv_mesh, "vllm:prefix_cache_hits_total") == 0
    # The gateway's /metrics answers for the cluster: engine b's kvstore hits, by heartbeat.
    poll(lambda: gateway_metric(kv_mesh, "vllm:external_prefix_cache_hits_total",
                                engine="b") == cached(on_b), 10,
         "the gateway to re-export engine b's kvstore hits")
    cold = complete(kv_mesh, prompt, "cold-on-b")   # another salt: nothing to reuse
    assert cached(cold) == 0
    assert cold["choices"][0]["text"] == on_a["choices"][0]["text"]


def computed_then_reset(mesh: Mesh, prompt: list[int], salt: str) -> str:
    """Computes the prompt and reuses it (which saves it), then empties the engine's own
    prefix cache: the next run of the prompt can only reuse it from the kvstore."""
    before = stored_blocks(mesh)
    text = complete(mesh, prompt, salt)["choices"][0]["text"]
    assert complete(mesh, prompt, salt)["choices"][0]["text"] == text
    wait_until_stored(mesh, before + (len(prompt) - 1) // BLOCK)
    reset_prefix_cache(mesh)
    return text


def test_a_corrupted_block_is_recomputed(kv_mesh: Mesh, proxy: FaultProxy) -> None:
    prompt = tokens(400, seed=2)
    reference = computed_then_reset(kv_mesh, prompt, "corrupt")
    failures = metric(kv_mesh, "llm_mesh:kv_load_failures_total")
    proxy.faults.corrupt_block = 5
    try:
        again = complete(kv_mesh, prompt, "corrupt")
    finally:
        proxy.faults.corrupt_block = None
    assert again["choices"][0]["text"] == reference
    assert cached(again) == 5 * BLOCK   # the blocks before the damaged one
    assert metric(kv_mesh, "llm_mesh:kv_load_failures_total") == failures + 1


def test_a_slow_store_times_out_while_the_engine_serves_others(kv_mesh: Mesh,
                                                                proxy: FaultProxy) -> None:
    prompt = tokens(400, seed=3)
    reference = computed_then_reset(kv_mesh, prompt, "slow")
    failures = metric(kv_mesh, "llm_mesh:kv_load_failures_total")
    done: dict[str, float] = {}

    def slow() -> None:
        started = time.monotonic()
        done["text"] = complete(kv_mesh, prompt, "slow")["choices"][0]["text"]
        done["slow_s"] = time.monotonic() - started
        done["slow_at"] = time.monotonic()

    gets = proxy.faults.num_gets
    proxy.faults.delay_per_block_s = 2.0   # 25 blocks would take 50 s
    try:
        thread = threading.Thread(target=slow)
        thread.start()
        while proxy.faults.num_gets == gets:
            time.sleep(0.05)
        complete(kv_mesh, tokens(20, seed=4), "other", max_tokens=4)
        done["other_at"] = time.monotonic()
        thread.join(timeout=120)
    finally:
        proxy.faults.delay_per_block_s = 0.0
    assert done["text"] == reference
    assert done["other_at"] < done["slow_at"]   # served while the slow load waited
    assert done["slow_s"] < LOAD_TIMEOUT_S + 20
    assert metric(kv_mesh, "llm_mesh:kv_load_failures_total") == failures + 1


def test_a_kvstore_killed_mid_load_ends_in_a_recompute(kv_mesh: Mesh,
                                                       proxy: FaultProxy) -> None:
    prompt = tokens(400, seed=5)
    reference = computed_then_reset(kv_mesh, prompt, "kill")
    failures = metric(kv_mesh, "llm_mesh:kv_load_failures_total")
    kvstore = kv_mesh.services["kvstore"]
    gets = proxy.faults.num_gets
    proxy.faults.delay_per_block_s = 0.1   # 25 blocks: 2.5 s, within the load timeout
    result: dict[str, object] = {}

    def run() -> None:
        started = time.monotonic()
        result["text"] = complete(kv_mesh, prompt, "kill")["choices"][0]["text"]
        result["seconds"] = time.monotonic() - started

    try:
        thread = threading.Thread(target=run)
        thread.start()
        while proxy.faults.num_gets == gets:
            time.sleep(0.02)
        time.sleep(0.4)
        assert kvstore.process is not None
        kvstore.process.send_signal(signal.SIGKILL)
        thread.join(timeout=120)
    finally:
        proxy.faults.delay_per_block_s = 0.0
    assert kvstore.process.poll() is not None
    assert result["text"] == reference
    assert metric(kv_mesh, "llm_mesh:kv_load_failures_total") == failures + 1
    kv_mesh.restart("kvstore")
    ready_deadline = time.monotonic() + 60
    while kvstore.get("/ready")[0] != 200:
        assert time.monotonic() < ready_deadline, kvstore.log_tail()
        time.sleep(0.2)


def test_a_producer_and_a_consumer_serve_a_request_like_one_engine(kv_mesh: Mesh) -> None:
    prompt = tokens(600, seed=6)
    single = complete(kv_mesh, prompt, "single-engine")["choices"][0]["text"]
    kv_mesh.remove_service(SCHEDULER_B)
    kv_mesh.remove_service("worker-b")
    kv_mesh.add_engine("prefill", scheduler_args=["--kv-role", "producer"])
    # add_engine returns once the gateway counts the engine ready, from the heartbeat that
    # also carries its role: the gateway knows both roles now.
    kv_mesh.add_engine("decode", scheduler_args=["--kv-role", "consumer"])
    disaggregated = complete(kv_mesh, prompt, "pd")
    assert disaggregated["choices"][0]["text"] == single
    assert cached(disaggregated) == 599 // BLOCK * BLOCK
    assert metric(kv_mesh, "llm_mesh:kv_saved_blocks_total", "scheduler-prefill") == 600 // BLOCK
    assert metric(kv_mesh, "vllm:external_prefix_cache_hits_total",
                  "scheduler-decode") == cached(disaggregated)
    assert metric(kv_mesh, "vllm:prompt_tokens_total", "scheduler-decode") == 600


def test_the_kvstore_stays_within_its_memory_bound_under_a_soak(kv_mesh: Mesh,
                                                                proxy: FaultProxy) -> None:
    """Bounded soak through the data plane: 3x the CPU tier in 1 MiB blocks."""
    process = kv_mesh.services["kvstore"].process
    assert process is not None

    async def soak() -> None:
        async with stub_for(f"127.0.0.1:{proxy.upstream_port}") as stub:
            for round_ in range(3 * CPU_BYTES // (16 << 20)):
                await stub.put(put_messages([(os.urandom(32), os.urandom(1 << 20))
                                             for _ in range(16)], fingerprint="soak"))

    asyncio.run(soak())
    rss = rss_bytes(process.pid)
    assert rss < CPU_BYTES + 200 * 1024 * 1024, rss


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
