"""API keys and what each key's tenant gets: its own prefix-cache salt and token bucket.

Keys come from --api-key (several allowed). A request's `Authorization: Bearer <key>` is
compared with every key in constant time. Each key is a tenant:

- **cache salt**: HMAC-SHA256 keyed by the API key. Every request of the tenant carries it
  in front of any client `cache_salt`, so two tenants never share a prefix-cache block (a
  shared block would leak, through time to first token, that another tenant sent the same
  prefix). The same key gives the same salt on every gateway replica.
- **token bucket** (--rate-limit-tokens-per-minute): see rate_limit.py; with --redis-url
  every gateway replica and batch runner shares each key's bucket there.
- **key id**: a short hash of the key, the only form of it that appears in logs (the
  `api_key` field of the gateway's `request finished` line), and the owner recorded on the
  tenant's batch files and batches; a batch runner maps it back to the tenant to run the
  batch's lines as that tenant.

With no key configured the API is open and every request is one anonymous tenant: no salt
is added (client salts pass through), and the rate limit, if set, is shared.
"""

from __future__ import annotations

import hashlib
import hmac
import math

from starlette.requests import Request

from services.frontend.errors import ApiError
from services.frontend.settings import TenantSettings
from services.frontend.tenancy.rate_limit import (
    Bucket,
    SharedTokenBucket,
    TokenBucket,
    redis_client,
)

_SALT_MESSAGE = b"llm-mesh prefix-cache salt"


class Tenant:
    def __init__(self, key_id: str, salt: str, bucket: Bucket | None) -> None:
        self.key_id = key_id
        self._salt = salt
        self._bucket = bucket

    def cache_salt(self, client_salt: str) -> str:
        """The salt a request of this tenant is hashed with: the tenant's, then the client's."""
        if not self._salt:
            return client_salt
        return f"{self._salt}:{client_salt}" if client_salt else self._salt

    async def charge(self, num_tokens: int) -> None:
        """Pays for a request of `num_tokens` (prompt + max_tokens); 429 if the bucket is
        short, 400 if the request is larger than the bucket could ever hold."""
        if self._bucket is None:
            return
        short = await self._bucket.take(num_tokens)
        if short is None:
            return
        if math.isinf(short.wait_s):
            raise ApiError(400, f"the request may use {num_tokens} tokens (prompt + "
                                f"max_tokens), more than this API key's rate limit allows at "
                                f"once ({int(self._bucket.capacity)}); lower max_tokens",
                           param="max_tokens", code="rate_limit_exceeded")
        raise ApiError(429, f"Rate limit reached for this API key: the request may use "
                            f"{num_tokens} tokens (prompt + max_tokens) and "
                            f"{int(short.available)} are available now; retry after "
                            f"{math.ceil(short.wait_s)} s", code="rate_limit_exceeded",
                       retry_after_s=max(1.0, math.ceil(short.wait_s)))


class ApiKeys:
    def __init__(self, keys: list[str], tokens_per_minute: int = 0,
                 burst_tokens: int = 0, admin_keys: list[str] | None = None,
                 redis_url: str = "", namespace: str = "mesh") -> None:
        """`admin_keys` are tenants too, that may also call the admin endpoints. With
        `redis_url`, the token buckets are shared (per namespace) by every process using
        that Redis."""
        self._redis = redis_client(redis_url) if redis_url and tokens_per_minute > 0 else None

        def bucket(tenant_id: str) -> Bucket | None:
            if tokens_per_minute <= 0:
                return None
            local = TokenBucket(tokens_per_minute / 60.0, burst_tokens or tokens_per_minute)
            if self._redis is None:
                return local
            return SharedTokenBucket(self._redis, f"llm-mesh:{namespace}:rate-limit:"
                                                  f"{tenant_id or 'open'}", local)

        keys = list(dict.fromkeys([*keys, *(admin_keys or [])]))
        self._tenants = [(key.encode(), Tenant(key_id(key), tenant_salt(key),
                                               bucket(key_id(key))))
                         for key in keys]
        self._anonymous = None if keys else Tenant("", "", bucket(""))   # no key: no id
        self._by_key_id = {tenant.key_id: tenant for _, tenant in self._tenants}
        self._admin_ids = {key_id(key) for key in admin_keys or []}

    @classmethod
    def from_settings(cls, settings: TenantSettings, namespace: str) -> ApiKeys:
        return cls(settings.api_key, settings.rate_limit_tokens_per_minute,
                   settings.rate_limit_burst_tokens, settings.admin_api_key,
                   settings.redis_url, namespace)

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()

    def may_administer(self, tenant: Tenant | None) -> bool:
        """Admin endpoints: open with no key configured, else for admin keys only."""
        return self._anonymous is not None or (tenant is not None
                                               and tenant.key_id in self._admin_ids)

    @property
    def required(self) -> bool:
        return self._anonymous is None

    def identify(self, authorization: str) -> Tenant | None:
        """The tenant of an Authorization header; None when it names no valid key."""
        if self._anonymous is not None:
            return self._anonymous
        token = authorization[7:].strip().encode() \
            if authorization[:7].lower() == "bearer " else b""
        found = None
        for key, tenant in self._tenants:   # NOTE: no early exit: constant time over keys
            if hmac.compare_digest(token, key):
                found = tenant
        return found

    def by_key_id(self, key_id: str) -> Tenant | None:
        """The tenant whose key has this id (with no key configured: the anonymous tenant,
        id ""); None when no configured key has it. Key ids are hashes, not secrets: no
        constant-time compare needed."""
        if self._anonymous is not None:
            return self._anonymous if key_id == "" else None
        return self._by_key_id.get(key_id)


def tenant_of(request: Request) -> Tenant | None:
    """The tenant the auth middleware found for an HTTP request (None: not through HTTP)."""
    return getattr(request.state, "tenant", None)


def owner_of(request: Request) -> str:
    """The caller's key id ("" without API keys): the owner of what it stores (files,
    batches, responses), and the only owner whose things it sees."""
    tenant = tenant_of(request)
    return tenant.key_id if tenant is not None else ""


def key_id(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def tenant_salt(key: str) -> str:
    return hmac.new(key.encode(), _SALT_MESSAGE, hashlib.sha256).hexdigest()[:32]
