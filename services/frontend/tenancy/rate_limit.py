"""Per-tenant token-rate limits: a token bucket over prompt + max_tokens.

A request pays for its prompt tokens plus the most it may generate (max_tokens, per choice)
when it is admitted, before it reaches an engine; an empty bucket answers 429 with
Retry-After (when the bucket will hold enough again). Unused tokens are not refunded: the
limit bounds what a tenant may ask of the mesh, as OpenAI's token limits do.

With a Redis URL the buckets live in Redis (SharedTokenBucket), so a key's limit holds
across every gateway replica and batch runner; a Redis that does not answer leaves each
process to its own bucket until it answers again (the limit loosens, requests still flow).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
import redis.exceptions
import structlog

log = structlog.get_logger(__name__)

REDIS_TIMEOUT_S = 0.5   # a rate check must never hold a request up for long

# The bucket's refill and take, atomic in Redis on Redis's clock (replicas' clocks differ).
# The key expires once the bucket would be full again: a full bucket needs no state.
_TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, capacity, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'updated')
local tokens = tonumber(state[1]) or capacity
local updated = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - updated) * rate)
local wait = -1
if amount <= tokens then tokens = tokens - amount else wait = (amount - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.6f', tokens),
           'updated', string.format('%.6f', now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) / rate * 1000) + 1000)
return {string.format('%.6f', wait), string.format('%.6f', tokens)}
"""


@dataclass(frozen=True)
class Shortfall:
    """Why a take failed: the seconds until the bucket holds enough (math.inf: never, the
    amount is over its capacity), and what it holds now."""
    wait_s: float
    available: float


class Bucket(Protocol):
    capacity: float

    async def take(self, amount: float) -> Shortfall | None:
        """Takes `amount` tokens: None if taken, else what was short."""
        ...


class TokenBucket:
    """`rate_per_s` tokens flow in per second, up to `capacity`; starts full."""

    def __init__(self, rate_per_s: float, capacity: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate_per_s <= 0 or capacity <= 0:
            raise ValueError("a token bucket needs a positive rate and capacity")
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self._clock = clock
        self._tokens = capacity
        self._updated = clock()

    @property
    def available(self) -> float:
        self._refill()
        return self._tokens

    async def take(self, amount: float) -> Shortfall | None:
        return self.try_take(amount)

    def try_take(self, amount: float) -> Shortfall | None:
        if amount > self.capacity:
            return Shortfall(math.inf, self.available)
        self._refill()
        if amount <= self._tokens:
            self._tokens -= amount
            return None
        return Shortfall((amount - self._tokens) / self.rate_per_s, self._tokens)

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate_per_s)
        self._updated = now


class SharedTokenBucket:
    """A TokenBucket kept in Redis under `key`, shared by every process that names it;
    `fallback` (this process's own bucket) answers while Redis does not."""

    def __init__(self, client: aioredis.Redis, key: str, fallback: TokenBucket) -> None:
        self.capacity = fallback.capacity
        self._key = key
        self._fallback = fallback
        self._take = client.register_script(_TAKE)
        self._redis_failing = False

    async def take(self, amount: float) -> Shortfall | None:
        if amount > self.capacity:
            return Shortfall(math.inf, self.capacity)
        try:
            wait_s, available = await self._take(
                keys=[self._key], args=[self._fallback.rate_per_s, self.capacity, amount])
        except (redis.exceptions.RedisError, OSError) as exc:
            if not self._redis_failing:
                log.warning("rate-limit Redis unavailable: this process limits on its own "
                            "until it answers", error=str(exc) or type(exc).__name__)
                self._redis_failing = True
            return self._fallback.try_take(amount)
        if self._redis_failing:
            log.info("rate-limit Redis answers again: limits are shared")
            self._redis_failing = False
        wait = float(wait_s)
        return None if wait < 0 else Shortfall(wait, float(available))


def redis_client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, socket_timeout=REDIS_TIMEOUT_S,
                                   socket_connect_timeout=REDIS_TIMEOUT_S)
