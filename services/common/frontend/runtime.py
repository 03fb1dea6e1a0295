"""What a service that serves OpenAI requests (the gateway, the batch runner) runs beside
them: a view of the mesh kept from heartbeats, the mesh client, and a sweep that hands a
lost instance's requests on (moved to live ones, or ended with a retriable error) and
moves the requests of engines that hang (the stall watchdog)."""

from __future__ import annotations

import asyncio
from typing import Any

from services.common import wire
from services.common.bus import Bus
from services.common.frontend.context import FrontendContext
from services.common.frontend.mesh_client import MeshClient
from services.common.frontend.mesh_view import MeshView
from services.common.frontend.settings import FrontendSettings
from services.common.metrics import GatewayMetrics
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks

SWEEP_INTERVAL_S = 0.5


class FrontendRuntime:
    def __init__(self, settings: FrontendSettings, metrics: GatewayMetrics, log: Any) -> None:
        self.settings = settings
        self.metrics = metrics
        self.log = log
        self.view = MeshView(stale_after_s=settings.instance_timeout_s,
                             stall_after_s=settings.stall_timeout_s)
        self.client: MeshClient | None = None

    async def start(self, bus: Bus, subjects: Subjects, instance_id: str,
                    tasks: BackgroundTasks) -> FrontendContext:
        """Joins the mesh as `instance_id` (tokenizers send its requests' text there)."""
        self.client = MeshClient(bus, subjects, instance_id, self.view,
                                 self.settings.tokenizer_timeout_s,
                                 migration_timeout_s=self.settings.migration_timeout_s,
                                 metrics=self.metrics)
        await self.client.start(tasks)
        await bus.subscribe(subjects.heartbeat, wire.Heartbeat, self._on_heartbeat)
        tasks.spawn(self._sweep_loop(self.client), name="sweep lost instances")
        return FrontendContext(self.settings, self.client, self.view, self.metrics)

    async def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if self.view.on_heartbeat(beat):
            self.metrics.instances_started.labels(beat.service).inc()

    async def _sweep_loop(self, client: MeshClient) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            for instance in self.view.sweep():
                self.metrics.instances_lost.labels(instance.service).inc()
                failed = client.fail_instance(instance)
                self.log.warning("service instance gone", service=instance.service,
                                 instance=instance.instance_id, failed_requests=failed)
            client.move_stalled()
