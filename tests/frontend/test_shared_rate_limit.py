"""Rate limits shared through a real Redis-protocol server: every gateway replica (and batch
runner) on one Redis draws each key's tokens from one bucket; a Redis that does not answer
leaves each process limiting on its own until it answers again."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from llm_mesh.embedded import EmbeddedRedis
from services.common.ports import free_port
from services.frontend.errors import ApiError
from services.frontend.tenancy.auth import ApiKeys, Tenant, key_id

# 60 tokens a minute = 1 a second, 100 at once.
LIMITS = {"tokens_per_minute": 60, "burst_tokens": 100}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password="s3cret") as server:
        yield server


@pytest.fixture
async def replicas(redis_server: EmbeddedRedis,
                   request: pytest.FixtureRequest) -> AsyncIterator[list[ApiKeys]]:
    """Two gateways' keys on one Redis, in a namespace of their own."""
    keys = [ApiKeys(["alpha", "beta"], **LIMITS, redis_url=redis_server.url,
                    namespace=request.node.name) for _ in range(2)]
    yield keys
    for k in keys:
        await k.close()


def tenant(keys: ApiKeys, key: str) -> Tenant:
    found = keys.identify(f"Bearer {key}")
    assert found is not None
    return found


async def refusal(t: Tenant, num_tokens: int) -> ApiError:
    with pytest.raises(ApiError) as refused:
        await t.charge(num_tokens)
    return refused.value


async def test_replicas_draw_a_key_from_one_bucket(replicas: list[ApiKeys],
                                                   redis_server: EmbeddedRedis) -> None:
    first, second = replicas
    await tenant(first, "alpha").charge(100)
    refused = await refusal(tenant(second, "alpha"), 30)
    assert refused.status == 429 and refused.code == "rate_limit_exceeded"
    # 30 tokens at 1 a second, less what flowed in since the first charge (a few seconds at
    # most, even on a loaded machine); a bucket of its own would have taken them.
    assert refused.retry_after_s is not None and 20 <= refused.retry_after_s <= 30
    await tenant(second, "beta").charge(100)   # another key: its own bucket
    other_namespace = ApiKeys(["alpha"], **LIMITS, redis_url=redis_server.url,
                              namespace="elsewhere")
    await tenant(other_namespace, "alpha").charge(100)   # another mesh on the same Redis
    await other_namespace.close()
    # The bucket's state expires once it would be full again: a full bucket needs none.
    client = aioredis.Redis.from_url(redis_server.url)
    key = f"llm-mesh:test_replicas_draw_a_key_from_one_bucket:rate-limit:{key_id('alpha')}"
    assert 0 < await client.pttl(key) <= 101_000
    await client.aclose()


async def test_a_request_larger_than_the_bucket_is_400_without_asking_redis(
        replicas: list[ApiKeys]) -> None:
    too_big = await refusal(tenant(replicas[0], "alpha"), 101)
    assert too_big.status == 400 and too_big.param == "max_tokens"
    await tenant(replicas[1], "alpha").charge(100)   # nothing was taken


async def test_without_redis_each_replica_limits_alone_until_it_answers() -> None:
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    first = ApiKeys(["alpha"], **LIMITS, redis_url=url)
    await tenant(first, "alpha").charge(40)             # nobody listens: this process's bucket
    assert (await refusal(tenant(first, "alpha"), 70)).status == 429   # still limited
    with EmbeddedRedis(port=port):
        second = ApiKeys(["alpha"], **LIMITS, redis_url=url)
        await tenant(second, "alpha").charge(100)       # Redis's bucket started full
        # The first replica's own bucket still holds 60; Redis's shared one refuses.
        assert (await refusal(tenant(first, "alpha"), 30)).status == 429
        await second.close()
    await first.close()
