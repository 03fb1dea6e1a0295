"""Batch fixtures: a nats-server with JetStream, a batch store on a fresh namespace per test
(so tests never see each other's jobs), and gateways (the real app, auth included) on it."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx2 as httpx
import nats
import pytest
from prometheus_client import CollectorRegistry

from llm_mesh.embedded import EmbeddedNats
from services.common.bus import Bus
from services.common.metrics import GatewayMetrics
from services.common.subjects import Subjects
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.context import FrontendContext
from services.frontend.engine_client.mesh_view import MeshView
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

_namespaces = itertools.count()
Gateway = Callable[[list[str]], httpx.AsyncClient]   # API keys -> a client of a new gateway


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats().start()
    yield server
    server.stop()


@pytest.fixture
async def store(nats_server: EmbeddedNats) -> AsyncIterator[BatchStore]:
    client = await nats.connect(nats_server.url)
    yield await BatchStore.open(client.jetstream(), Subjects(f"t{next(_namespaces)}"))
    await client.close()


class _Client:
    gateway_id = "batch-test"   # all the files and batches API uses of the mesh client


@pytest.fixture
async def buses(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[Bus]]:
    """Every Bus the test connects, in order; closed after the test."""
    connected: list[Bus] = []
    connect = Bus.connect

    async def tracked_connect(*args: Any, **kwargs: Any) -> Bus:
        connected.append(await connect(*args, **kwargs))
        return connected[-1]

    monkeypatch.setattr(Bus, "connect", tracked_connect)
    yield connected
    for bus in connected:
        await bus.close()


@pytest.fixture
async def gateway(nats_server: EmbeddedNats, buses: list[Bus]) -> AsyncIterator[Gateway]:
    """Makes gateways on one fresh namespace: they share one batch plane, as replicas do.
    Their NATS connections close after the test."""
    namespace = f"gateway{next(_namespaces)}"
    clients: list[httpx.AsyncClient] = []

    def make(keys: list[str]) -> httpx.AsyncClient:
        settings = GatewaySettings(nats_url=nats_server.url, namespace=namespace, api_key=keys)
        ctx = FrontendContext(settings, _Client(), MeshView(60.0),  # type: ignore[arg-type]
                              GatewayMetrics(CollectorRegistry()))
        app = create_app(ctx, CollectorRegistry())
        clients.append(httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway"))
        return clients[-1]

    yield make
    for client in clients:
        await client.aclose()
