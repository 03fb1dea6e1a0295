"""What every gateway handler needs, in one object."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.metrics import GatewayMetrics
from services.gateway.generation import GenerationRun, new_request_id
from services.gateway.mesh_client import MeshClient
from services.gateway.mesh_view import MeshView
from services.gateway.request_stats import RequestTimer
from services.gateway.settings import GatewaySettings


@dataclass
class GatewayContext:
    settings: GatewaySettings
    client: MeshClient
    view: MeshView
    metrics: GatewayMetrics

    def new_run(self, id_prefix: str, model: str) -> GenerationRun:
        request_id = new_request_id(id_prefix)
        return GenerationRun(self.client, self.view, request_id, self.settings.request_timeout_s,
                             RequestTimer(self.metrics, model, request_id))
