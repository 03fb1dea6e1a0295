"""What every request handler needs (in the gateway or the batch runner), in one object."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.frontend.engine_router import EngineRouter
from services.common.frontend.generation import GenerationRun, new_request_id
from services.common.frontend.lora_registry import LoraRegistry
from services.common.frontend.mesh_client import MeshClient
from services.common.frontend.mesh_view import MeshView
from services.common.frontend.request_stats import RequestTimer
from services.common.frontend.settings import FrontendSettings
from services.common.metrics import GatewayMetrics


@dataclass
class FrontendContext:
    settings: FrontendSettings
    client: MeshClient
    view: MeshView
    metrics: GatewayMetrics
    router: EngineRouter | None = None
    loras: LoraRegistry = field(init=False)   # --lora-modules, then the load/unload API

    def __post_init__(self) -> None:
        self.loras = LoraRegistry.from_specs(self.settings.lora_modules)

    def new_run(self, id_prefix: str, model: str) -> GenerationRun:
        request_id = new_request_id(id_prefix)
        return GenerationRun(self.client, self.view, request_id, self.settings.request_timeout_s,
                             RequestTimer(self.metrics, model, request_id), router=self.router,
                             engine_wait_s=self.settings.engine_wait_s, loras=self.loras)
