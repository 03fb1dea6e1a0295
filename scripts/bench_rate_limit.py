"""What a shared rate limit costs a request: the time of one Tenant.charge with the token
bucket in this process vs in Redis (an embedded valkey-server on loopback, as `llm-mesh up`
runs it), medians and P99 over --calls charges after a warm-up.

    python scripts/bench_rate_limit.py [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from llm_mesh.embedded import EmbeddedRedis
from services.gateway.auth import ApiKeys

WARMUP_CALLS = 200
LIMIT = 10**9   # tokens a minute: never refuses, so every call is one take


async def timed_charges(keys: ApiKeys, calls: int) -> list[float]:
    tenant = keys.identify("Bearer bench-key")
    assert tenant is not None
    for _ in range(WARMUP_CALLS):
        await tenant.charge(1)
    samples = []
    for _ in range(calls):
        started = time.perf_counter()
        await tenant.charge(1)
        samples.append(time.perf_counter() - started)
    await keys.close()
    return sorted(samples)


async def main(calls: int) -> None:
    with EmbeddedRedis() as redis:
        for name, redis_url in (("in this process", ""), ("shared in Redis", redis.url)):
            samples = await timed_charges(
                ApiKeys(["bench-key"], tokens_per_minute=LIMIT, redis_url=redis_url), calls)
            p99 = samples[int(len(samples) * 0.99)]
            print(f"bucket {name:>16}: median {statistics.median(samples) * 1e6:7.0f} us, "
                  f"P99 {p99 * 1e6:7.0f} us ({calls} charges)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    asyncio.run(main(parser.parse_args().calls))
