"""The gateway service: serves the OpenAI-compatible API with uvicorn inside the service
lifecycle, and watches heartbeats to know what the mesh holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from services.common import wire
from services.common.metrics import GatewayMetrics
from services.common.service import Service
from services.gateway.app import create_app
from services.gateway.context import GatewayContext
from services.gateway.engine_collector import EngineCollector
from services.gateway.mesh_client import MeshClient
from services.gateway.mesh_view import MeshView
from services.gateway.settings import GatewaySettings


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The service lifecycle owns SIGTERM / SIGINT and drains through should_exit.
        yield


class GatewayService(Service):
    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        super().__init__(settings)
        self.settings: GatewaySettings = settings
        self.view = MeshView(stale_after_s=settings.instance_timeout_s)
        self.metrics = GatewayMetrics(self.registry)
        self.registry.register(EngineCollector(self.view))
        self.client: MeshClient | None = None
        self.server: _Server | None = None
        self.app: FastAPI | None = None
        self._serving: asyncio.Task[None] | None = None

    async def setup(self) -> None:
        bus = self.connected_bus
        self.client = MeshClient(bus, self.subjects, self.instance_id, self.view,
                                 self.settings.tokenizer_timeout_s,
                                 migration_timeout_s=self.settings.migration_timeout_s,
                                 metrics=self.metrics)
        await self.client.start()
        await bus.subscribe(self.subjects.heartbeat, wire.Heartbeat, self._on_heartbeat)
        asyncio.create_task(self._sweep_loop())
        self.app = create_app(GatewayContext(self.settings, self.client, self.view,
                                             self.metrics), self.registry)
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port,
                                log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(self.settings.drain_timeout_s))
        self.server = _Server(config)
        self._serving = asyncio.create_task(self.server.serve())
        while not self.server.started:
            if self._serving.done():
                self._serving.result()  # raises the bind error
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.02)
        self.log.info("OpenAI-compatible API listening",
                      url=f"http://{self.settings.host}:{self.settings.port}/v1")

    async def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if self.view.on_heartbeat(beat):
            self.metrics.instances_started.labels(beat.service).inc()

    async def _sweep_loop(self) -> None:
        assert self.client is not None
        while True:
            await asyncio.sleep(0.5)
            for instance in self.view.sweep():
                self.metrics.instances_lost.labels(instance.service).inc()
                failed = self.client.fail_instance(instance)
                self.log.warning("service instance gone", service=instance.service,
                                 instance=instance.instance_id, failed_requests=failed)

    def readiness(self) -> tuple[bool, str]:
        return (True, "") if self.server is not None and self.server.started else \
            (False, "HTTP server not started")

    async def drain(self) -> None:
        if self.server is not None and self._serving is not None:
            self.server.should_exit = True  # stop accepting; finish open requests
            await self._serving

    async def close(self) -> None:
        if self.app is not None:
            await self.app.state.api_keys.close()
