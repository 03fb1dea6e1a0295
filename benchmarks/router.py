"""KV router CPU cost per routing decision (issue 15's goal: < 1 ms P99 with 100k indexed
blocks across 8 engines). No model, no NATS: the index and the cost function alone.

The index is built from KV events as engines would publish them: conversations of 64-512
blocks, each opening with one of a few shared system prompts, each held by one engine (some
by two, after a spill), the system prompts by every engine. Requests are chains of 100-300
blocks: most continue a held conversation with a few new blocks, the rest are new
conversations on a held system prompt. A decision is `overlaps` + `RoutingCost.choose`;
the request's hashes are fresh bytes objects, as the gateway's hasher would make them.

Run: .venv/bin/python -m benchmarks.router [--num-blocks 100000 --num-engines 8]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from benchmarks.harness import distribution, print_preamble
from services.common import wire
from services.frontend.router import EngineLoad, PrefixIndex, RoutingCost

BLOCK_SIZE = 16
NUM_SYSTEM_PROMPTS = 4
SYSTEM_PROMPT_BLOCKS = 32


def build_index(rng: random.Random, num_blocks: int, engines: list[str],
                system_prompts: list[list[bytes]]) -> tuple[PrefixIndex, list[list[bytes]]]:
    """Stores conversations until the index holds `num_blocks` distinct blocks."""
    index = PrefixIndex()
    for prompt in system_prompts:
        for engine in engines:
            index.apply(engine, [stored(prompt)])
    conversations = []
    while index.num_blocks < num_blocks:
        chain = rng.choice(system_prompts) + [rng.randbytes(32) for _ in range(
            rng.randint(64, 512) - SYSTEM_PROMPT_BLOCKS)]
        for engine in rng.sample(engines, 2 if rng.random() < 0.3 else 1):
            index.apply(engine, [stored(chain[SYSTEM_PROMPT_BLOCKS:])])
        conversations.append(chain)
    return index, conversations


def stored(hashes: list[bytes]) -> wire.KvEvent:
    return wire.KvEvent(stored=wire.BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE,
                                                medium=wire.KvMedium.GPU))


def make_request(rng: random.Random, conversations: list[list[bytes]],
                 system_prompts: list[list[bytes]]) -> list[bytes]:
    length = rng.randint(100, 300)
    held = rng.choice(conversations) if rng.random() < 0.8 else rng.choice(system_prompts)
    chain = held[:length] + [rng.randbytes(32) for _ in range(length - len(held[:length]))]
    return [bytes(bytearray(h)) for h in chain]   # fresh objects: no cached hash


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=100_000)
    parser.add_argument("--num-engines", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--overlap-weight", type=float, default=1.0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print_preamble()

    rng = random.Random(args.seed)
    engines = [f"engine-{i}" for i in range(args.num_engines)]
    system_prompts = [[rng.randbytes(32) for _ in range(SYSTEM_PROMPT_BLOCKS)]
                      for _ in range(NUM_SYSTEM_PROMPTS)]
    started = time.perf_counter()
    index, conversations = build_index(rng, args.num_blocks, engines, system_prompts)
    print(f"index: {index.num_blocks} blocks, {len(conversations)} conversations, "
          f"{args.num_engines} engines, built from events in "
          f"{time.perf_counter() - started:.2f} s")

    cost = RoutingCost(BLOCK_SIZE, args.overlap_weight, args.temperature, random.Random(1))
    requests = [make_request(rng, conversations, system_prompts)
                for _ in range(args.num_requests)]
    loads = [{e: EngineLoad(rng.randint(0, 1000), rng.randint(0, 100)) for e in engines}
             for _ in range(64)]
    gc.collect()
    elapsed_ns, num_cached_blocks = [], 0
    for i, chain in enumerate(requests):
        t0 = time.perf_counter_ns()
        decision = cost.choose(len(chain), loads[i % len(loads)], index.overlaps(chain))
        elapsed_ns.append(time.perf_counter_ns() - t0)
        num_cached_blocks += decision.num_predicted_cached_tokens // BLOCK_SIZE

    d = distribution([ns * 1e-9 for ns in elapsed_ns])
    print(f"routing decision ({len(requests)} requests of 100-300 blocks, "
          f"{num_cached_blocks / sum(map(len, requests)):.0%} of blocks predicted cached): "
          f"P50 {d.p50 * 1000:.1f} us, P99 {d.p99 * 1000:.1f} us, "
          f"max {max(elapsed_ns) / 1000:.1f} us; goal P99 < 1000 us: "
          f"{'met' if d.p99 < 1.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
