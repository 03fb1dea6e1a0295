"""Per-tenant token-rate limits: a token bucket over prompt + max_tokens.

A request pays for its prompt tokens plus the most it may generate (max_tokens, per choice)
when it is admitted, before it reaches an engine; an empty bucket answers 429 with
Retry-After (when the bucket will hold enough again). Unused tokens are not refunded: the
limit bounds what a tenant may ask of the mesh, as OpenAI's token limits do.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


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

    def try_take(self, amount: float) -> float | None:
        """Takes `amount` tokens: None if taken, else the seconds until they would be there.
        An amount over the capacity can never be taken: math.inf."""
        if amount > self.capacity:
            return math.inf
        self._refill()
        if amount <= self._tokens:
            self._tokens -= amount
            return None
        return (amount - self._tokens) / self.rate_per_s

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.capacity, self._tokens + (now - self._updated) * self.rate_per_s)
        self._updated = now
