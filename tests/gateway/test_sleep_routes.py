"""Sleep mode's endpoints at the gateway (services/gateway/sleep_routes.py): admin keys only
when keys are set, arguments checked before any engine is asked. The engines' side runs in
tests/e2e/test_sleep_mode.py."""

from __future__ import annotations

from types import SimpleNamespace

import httpx2 as httpx
import pytest
from prometheus_client import CollectorRegistry

from services.common.metrics import GatewayMetrics
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_view import MeshView
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

ENDPOINTS = [("POST", "/sleep?level=1"), ("POST", "/wake_up?tags=weights"),
             ("GET", "/is_sleeping")]


def gateway_client() -> httpx.AsyncClient:
    settings = GatewaySettings(api_key=["tenant"], admin_api_key=["operator"])
    ctx = FrontendContext(settings, SimpleNamespace(gateway_id="sleep-test"),  # type: ignore[arg-type]
                         MeshView(60.0), GatewayMetrics(CollectorRegistry()))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx, CollectorRegistry())),
                             base_url="http://gateway")


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
async def test_only_an_admin_key_reaches_the_engines(method: str, path: str) -> None:
    async with gateway_client() as http:
        refused = await http.request(method, path, headers={"Authorization": "Bearer tenant"})
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "permission_denied"
        # The admin passes auth and reaches the engines: none is running in this test.
        reached = await http.request(method, path, headers={"Authorization": "Bearer operator"})
        assert reached.status_code == 503
        assert reached.json()["error"]["code"] == "engine_unavailable"
        assert reached.headers["Retry-After"] == "1"


async def test_a_sleep_level_other_than_1_or_2_is_refused_before_any_engine_is_asked() -> None:
    async with gateway_client() as http:
        refused = await http.post("/sleep?level=0", headers={"Authorization": "Bearer operator"})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "level"
