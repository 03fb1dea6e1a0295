"""The kvstore's two figures, in one run against one `llm-mesh up` (kvstore on, its default):

1. TTFT of a 2,000-token prompt on an engine that does not hold it, loaded from the kvstore
   vs recomputed. Each prompt is sent once (computed; the worker writes its full blocks
   through to the store), then the engine's own prefix cache is emptied
   (`POST /reset_prefix_cache`), so the engine is in the place of a second engine: its pool
   lacks the prefix, the store has it. The same prompt again is *loaded*; a fresh prompt of
   the same length after the same reset is *recomputed*. TTFT is the time of a request
   for one output token (non-streaming), medians over --repeats prompts.
2. gRPC data-plane throughput on loopback: Put then Get of --blocks blocks of one fp32
   SmolLM2 block's size (720 KiB) against the mesh's kvstore node, from this process.

    python -m benchmarks.kvstore [--prompt-len 2000 --repeats 5 --blocks 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from grpclib.client import Channel

from benchmarks.harness import (REPO_ROOT, log_events, mesh_up, metrics_url, print_preamble,
                                scrape, service_health_urls, sum_of)
from services.common import wire
from services.common.kv_data_plane import GRPC_CONFIG, block_checksum

BLOCK_BYTES = 16 * 46080   # one 16-token block of SmolLM2-135M's fp32 KV
FINGERPRINT = "bench-kvstore-data-plane"


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read() or b"{}")


def timed_completion(url: str, model: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the one output token, prompt tokens served from a cache)."""
    started = time.perf_counter()
    body = post(f"{url}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1,
                                          "temperature": 0})
    elapsed = time.perf_counter() - started
    return elapsed, body["usage"]["prompt_tokens_details"]["cached_tokens"]


def stored_blocks(kvstore_metrics: str) -> float:
    return sum_of(scrape(kvstore_metrics), "llm_mesh:kvstore_put_blocks_total")


def wait_stored(kvstore_metrics: str, num_blocks: float, timeout_s: float = 60) -> None:
    """Until the node holds `num_blocks` blocks in all (write-through is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while stored_blocks(kvstore_metrics) < num_blocks:
        if time.monotonic() > deadline:
            raise TimeoutError("the worker's write-through did not reach the kvstore")
        time.sleep(0.2)


def ttft_loaded_vs_recomputed(url: str, kvstore_metrics: str, prompt_len: int,
                              repeats: int) -> None:
    model = json.loads(urllib.request.urlopen(f"{url}/v1/models").read())["data"][0]["id"]
    rng = random.Random(0)
    loaded, recomputed, loaded_cached = [], [], []
    full_blocks = prompt_len // 16
    for i in range(repeats):
        prompt = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        stored_before = stored_blocks(kvstore_metrics)
        elapsed, _ = timed_completion(url, model, prompt)           # computed, written through
        wait_stored(kvstore_metrics, stored_before + full_blocks)
        post(f"{url}/reset_prefix_cache", {})
        elapsed, cached = timed_completion(url, model, prompt)      # loaded from the store
        loaded.append(elapsed)
        loaded_cached.append(cached)
        post(f"{url}/reset_prefix_cache", {})
        fresh = [rng.randrange(1000, 40000) for _ in range(prompt_len)]
        elapsed, _ = timed_completion(url, model, fresh)            # nothing to load
        recomputed.append(elapsed)
        print(f"prompt {i}: loaded {loaded[-1] * 1e3:.0f} ms ({cached} cached tokens), "
              f"recomputed {recomputed[-1] * 1e3:.0f} ms", flush=True)
    load_ms, compute_ms = (1e3 * statistics.median(v) for v in (loaded, recomputed))
    print(f"\nTTFT of a {prompt_len}-token prompt the engine's pool lacks, median of "
          f"{repeats}: loaded from the kvstore {load_ms:.0f} ms "
          f"({statistics.median(loaded_cached):.0f} tokens loaded), recomputed "
          f"{compute_ms:.0f} ms: {compute_ms / load_ms:.1f}x faster loaded")


async def data_plane_throughput(address: str, num_blocks: int, rounds: int = 3) -> None:
    host, port = address.rsplit(":", 1)
    channel = Channel(host, int(port), config=GRPC_CONFIG)
    stub = wire.KvStoreStub(channel)
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(num_blocks)]
    total_mb = num_blocks * BLOCK_BYTES / 1e6
    put_s, get_s = [], []
    try:
        for r in range(rounds):
            hashes = [f"bench-{r}-{i}".encode().ljust(32, b".") for i in range(num_blocks)]
            messages = [wire.PutBlock(block_hash=h, data=d, checksum=block_checksum(d))
                        for h, d in zip(hashes, payloads)]
            messages[0].fingerprint = FINGERPRINT
            started = time.perf_counter()
            reply = await stub.put(messages)
            put_s.append(time.perf_counter() - started)
            assert reply.num_stored == num_blocks, reply
            started = time.perf_counter()
            got = [b async for b in stub.get(wire.GetRequest(fingerprint=FINGERPRINT,
                                                             block_hashes=hashes))]
            get_s.append(time.perf_counter() - started)
            assert len(got) == num_blocks
            await stub.delete(wire.DeleteRequest(fingerprint=FINGERPRINT, block_hashes=hashes))
    finally:
        channel.close()
    print(f"\ngRPC data plane on loopback, {num_blocks} blocks x {BLOCK_BYTES / 1024:.0f} KiB "
          f"({total_mb:.0f} MB), median of {rounds}: Put {total_mb / statistics.median(put_s):.0f}"
          f" MB/s, Get {total_mb / statistics.median(get_s):.0f} MB/s")


def kvstore_endpoints(log: Path) -> tuple[str, str]:
    """(gRPC address, /metrics URL) of the mesh's kvstore node, from `llm-mesh up`'s log."""
    address = next((e["address"] for e in log_events(log) if e.get("event") == "kvstore serving"),
                   "")
    health = service_health_urls(log).get("kvstore")
    if not address or not health:
        raise RuntimeError("no kvstore in this mesh (is the KV connector off?)")
    return address, metrics_url(health)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--up-args", default="", help="more `llm-mesh up` flags")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results" / "kvstore")
    args = parser.parse_args(argv)
    print_preamble()
    args.out.mkdir(parents=True, exist_ok=True)
    with mesh_up(args.up_args.split(), args.out / "mesh.log") as mesh:
        address, metrics = kvstore_endpoints(mesh.log)
        ttft_loaded_vs_recomputed(mesh.url, metrics, args.prompt_len, args.repeats)
        asyncio.run(data_plane_throughput(address, args.blocks))


if __name__ == "__main__":
    main()
