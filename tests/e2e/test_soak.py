"""A bounded soak of the real mesh: 32 clients keep requests in flight for a while. Every
request must complete, the engine must end idle with every KV block back in the pool, and
no service may keep growing in memory once warmed up (RSS at the end of the soak against
RSS at the end of a warm-up under the same load).

LLM_MESH_SOAK_S sets the measured part (default 60 s; the warm-up is a quarter of it).
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults.streams import poll, post_json
from tests.mesh import Mesh

pytestmark = pytest.mark.slow

CONCURRENCY = 32
SOAK_S = float(os.environ.get("LLM_MESH_SOAK_S", "60"))
# Allowed growth past the warm-up: allocator noise, not a leak (a leak grows with requests:
# ~1,000 of them here).
GROWTH_BYTES = 48 * 2**20
GROWTH_FRACTION = 0.10


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def service_rss(mesh: Mesh) -> dict[str, int]:
    return {name: rss_bytes(s.process.pid) for name, s in mesh.services.items()
            if s.process is not None and s.process.poll() is None}


def test_a_soak_at_concurrency_32_leaks_nothing(mesh: Mesh) -> None:
    url = f"{mesh.base_url}/v1/completions"
    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0.7,
            "ignore_eos": True}
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def client(index: int, until: float) -> None:
        n = 0
        while time.monotonic() < until:
            prompt = f"Client {index} asks question {n}: tell me about the number {n * 7 + index}"
            status, _, reply = post_json(url, {**body, "prompt": prompt}, timeout_s=120)
            completed = status == 200 and reply["usage"]["completion_tokens"] == 24
            with lock:
                outcomes["ok" if completed else f"{status}: {str(reply)[:200]}"] += 1
            n += 1

    def load(seconds: float) -> None:
        until = time.monotonic() + seconds
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lambda i: client(i, until), range(CONCURRENCY)))

    load(SOAK_S / 4)                         # warm-up: caches, allocator pools, batch shapes
    warm = service_rss(mesh)
    warm_ok = outcomes["ok"]
    load(SOAK_S)
    end = service_rss(mesh)

    assert set(outcomes) == {"ok"}, outcomes          # nothing failed, nothing hung
    assert outcomes["ok"] - warm_ok >= CONCURRENCY    # the soak did real work
    poll(lambda: mesh.scheduler_metric("vllm:num_requests_running") == 0
         and mesh.scheduler_metric("vllm:num_requests_waiting") == 0
         and mesh.scheduler_metric("vllm:kv_cache_usage_perc") == 0, 30,
         "the engine to be idle with every block free")
    grown = {name: end[name] - warm[name] for name in warm if name in end}
    print(f"soak: {outcomes['ok']} requests; RSS growth after warm-up (MiB): "
          f"{ {k: round(v / 2**20, 1) for k, v in grown.items()} }")
    for name, growth in grown.items():
        assert growth <= GROWTH_BYTES + GROWTH_FRACTION * warm[name], (name, warm[name], growth)
