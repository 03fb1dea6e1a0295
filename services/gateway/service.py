"""The gateway service: serves the OpenAI-compatible API with uvicorn inside the service
lifecycle, and watches heartbeats to know what the mesh holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from services.common.metrics import GatewayMetrics
from services.common.service import Service
from services.frontend.runtime import FrontendRuntime
from services.gateway.app import create_app
from services.gateway.engine_collector import EngineCollector
from services.gateway.engine_series import EngineSeries
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
        self.metrics = GatewayMetrics(self.registry)
        self.frontend = FrontendRuntime(settings, self.metrics, self.log)
        self.registry.register(EngineCollector(self.frontend.view))
        self.server: _Server | None = None
        self.app: FastAPI | None = None
        self._serving: asyncio.Task[None] | None = None

    async def setup(self) -> None:
        ctx = await self.frontend.start(self.connected_bus, self.subjects, self.instance_id,
                                        self.background)
        engine_series = EngineSeries(self.connected_bus, self.subjects, ctx.view,
                                     self.metrics.engine_scrape_failures)
        self.app = create_app(ctx, self.registry, engine_series)
        config = uvicorn.Config(self.app, host=self.settings.host, port=self.settings.port,
                                log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=int(self.settings.drain_timeout_s))
        self.server = _Server(config)
        self._serving = self.background.spawn(self.server.serve(), name="HTTP server")
        while not self.server.started:
            if self._serving.done():
                self._serving.result()  # raises the bind error
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.02)
        self.log.info("OpenAI-compatible API listening",
                      url=f"http://{self.settings.host}:{self.settings.port}/v1")

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
