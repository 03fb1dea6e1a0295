"""API keys, per-tenant prefix-cache salts, token-rate limits and admin keys at the gateway."""

from __future__ import annotations

import math
from collections.abc import Awaitable
from types import SimpleNamespace

import httpx2 as httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import GatewayMetrics
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_view import MeshView
from services.frontend.errors import ApiError
from services.frontend.tenancy.auth import ApiKeys, key_id
from services.frontend.tenancy.rate_limit import Shortfall, TokenBucket
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings


def test_only_a_configured_key_is_a_tenant() -> None:
    keys = ApiKeys(["alpha-key", "beta-key"])
    assert keys.required
    alpha = keys.identify("Bearer alpha-key")
    assert alpha is not None and alpha is keys.identify("bearer alpha-key")
    assert keys.identify("Bearer beta-key") not in (None, alpha)
    for header in ("", "Bearer", "Bearer wrong", "alpha-key", "Basic alpha-key",
                   "Bearer alpha-key-and-more"):
        assert keys.identify(header) is None, header


def test_tenants_never_share_a_cache_salt_and_replicas_agree() -> None:
    alpha = ApiKeys(["alpha-key", "beta-key"]).identify("Bearer alpha-key")
    beta = ApiKeys(["alpha-key", "beta-key"]).identify("Bearer beta-key")
    alpha_on_another_gateway = ApiKeys(["alpha-key"]).identify("Bearer alpha-key")
    assert alpha is not None and beta is not None and alpha_on_another_gateway is not None
    assert alpha.cache_salt("") != beta.cache_salt("")
    # A client's own salt cannot make two tenants collide: the tenant's comes first.
    assert alpha.cache_salt("shared") != beta.cache_salt("shared")
    assert alpha.cache_salt("x") == alpha_on_another_gateway.cache_salt("x")
    assert "alpha-key" not in alpha.cache_salt("") + alpha.key_id


async def test_without_keys_the_api_is_open_and_client_salts_pass_through() -> None:
    keys = ApiKeys([])
    tenant = keys.identify("")
    assert not keys.required and tenant is not None
    assert tenant.cache_salt("mine") == "mine" and tenant.cache_salt("") == ""
    await tenant.charge(10**9)   # no limit configured


def test_a_tenant_is_found_by_its_key_id_as_by_its_key() -> None:
    keys = ApiKeys(["alpha-key", "beta-key"])
    alpha = keys.identify("Bearer alpha-key")
    assert alpha is not None and keys.by_key_id(alpha.key_id) is alpha
    assert alpha.key_id == key_id("alpha-key")
    # Not a configured key's id, nor the open API's "" (the batch runner relies on both).
    for other in (key_id("revoked-key"), "", "alpha-key"):
        assert keys.by_key_id(other) is None, other
    open_api = ApiKeys([])
    assert open_api.by_key_id("") is open_api.identify("")
    assert open_api.by_key_id(alpha.key_id) is None


async def test_an_empty_bucket_answers_429_with_retry_after_and_a_huge_request_400() -> None:
    tenant = ApiKeys(["k"], tokens_per_minute=60, burst_tokens=100).identify("Bearer k")
    assert tenant is not None
    await tenant.charge(90)
    with pytest.raises(ApiError) as refused:
        await tenant.charge(50)
    assert refused.value.status == 429 and refused.value.code == "rate_limit_exceeded"
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    with pytest.raises(ApiError) as too_big:
        await tenant.charge(101)
    assert too_big.value.status == 400 and too_big.value.param == "max_tokens"


async def test_each_key_has_its_own_bucket() -> None:
    keys = ApiKeys(["a", "b"], tokens_per_minute=60, burst_tokens=10)
    a, b = keys.identify("Bearer a"), keys.identify("Bearer b")
    assert a is not None and b is not None
    await a.charge(10)
    await b.charge(10)   # a's spending leaves b's bucket full
    with pytest.raises(ApiError):
        await a.charge(1)


def test_token_bucket_refills_at_its_rate_up_to_its_capacity() -> None:
    now = [0.0]
    bucket = TokenBucket(rate_per_s=2.0, capacity=10.0, clock=lambda: now[0])
    assert bucket.try_take(10) is None
    assert bucket.try_take(4) == Shortfall(pytest.approx(2.0), 0.0)   # 4 tokens at 2/s
    now[0] = 1.5
    assert bucket.try_take(4) == Shortfall(pytest.approx(0.5), 3.0)   # 1 more in 0.5 s
    now[0] = 2.0
    assert bucket.try_take(4) is None and bucket.available == pytest.approx(0.0)
    now[0] = 100.0
    assert bucket.available == pytest.approx(10.0)    # capped
    short = bucket.try_take(11)
    assert short is not None and math.isinf(short.wait_s)


def test_only_admin_keys_may_call_admin_endpoints_when_keys_are_set() -> None:
    keys = ApiKeys(["tenant"], admin_keys=["operator"])
    tenant, operator = keys.identify("Bearer tenant"), keys.identify("Bearer operator")
    assert operator is not None and operator.cache_salt("") != tenant.cache_salt("")
    assert keys.may_administer(operator) and not keys.may_administer(tenant)
    assert not ApiKeys(["tenant"]).may_administer(ApiKeys(["tenant"]).identify("Bearer tenant"))
    open_api = ApiKeys([])
    assert open_api.may_administer(open_api.identify(""))


async def test_reset_prefix_cache_answers_403_to_a_tenant_key_and_runs_for_an_admin() -> None:
    settings = GatewaySettings(api_key=["tenant"], admin_api_key=["operator"])
    ctx = FrontendContext(settings, SimpleNamespace(gateway_id="auth-test"),  # type: ignore[arg-type]
                         MeshView(60.0), GatewayMetrics(CollectorRegistry()))
    app = create_app(ctx, CollectorRegistry())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        def reset(key: str) -> Awaitable[httpx.Response]:
            return http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {key}"})

        refused = await reset("tenant")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "permission_denied"
        assert (await reset("nobody")).status_code == 401
        # The admin passes auth and reaches the engines: none is running in this test.
        reached = await reset("operator")
        assert reached.status_code == 503
        assert reached.json()["error"]["code"] == "engine_unavailable"


async def test_a_missing_or_wrong_key_gets_an_openai_401_and_open_paths_need_none() -> None:
    settings = GatewaySettings(api_key=["tenant"])
    registry = CollectorRegistry()
    ctx = FrontendContext(settings, SimpleNamespace(gateway_id="auth-test"),  # type: ignore[arg-type]
                         MeshView(60.0), GatewayMetrics(registry))
    app = create_app(ctx, CollectorRegistry())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gateway") as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = await http.get("/v1/models", headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/version")).status_code == 200   # an open path
        allowed = await http.get("/v1/models", headers={"Authorization": "Bearer tenant"})
        assert allowed.status_code == 200 and allowed.json()["object"] == "list"
    assert registry.get_sample_value("llm_mesh:request_rejections_total",
                                     {"status": "401", "code": "invalid_api_key"}) == 2
