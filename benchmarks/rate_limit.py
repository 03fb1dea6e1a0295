"""What a shared rate limit costs a request: the time of one Tenant.charge with the token
bucket in this process vs in Redis (an embedded valkey-server on loopback, as `llm-mesh up`
runs it), medians and P99 over --calls charges after a warm-up.

    python -m benchmarks.rate_limit [--calls 3000]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence

from benchmarks.harness import distribution, markdown_table, print_preamble
from llm_mesh.embedded import EmbeddedRedis
from services.frontend.tenancy.auth import ApiKeys

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
    return samples


async def measure(calls: int) -> None:
    rows = []
    with EmbeddedRedis() as redis:
        for name, redis_url in (("in this process", ""), ("shared in Redis", redis.url)):
            d = distribution(await timed_charges(
                ApiKeys(["bench-key"], tokens_per_minute=LIMIT, redis_url=redis_url), calls))
            rows.append([name, f"{d.p50 * 1e3:.0f} us", f"{d.p99 * 1e3:.0f} us"])
    print(f"\n{calls} charges each\n")
    print(markdown_table(["token bucket", "charge median", "P99"], rows))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args(argv)
    print_preamble()
    asyncio.run(measure(args.calls))


if __name__ == "__main__":
    main()
