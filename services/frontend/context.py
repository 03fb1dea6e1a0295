"""What every request handler needs (in the gateway or the batch runner), in one object."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.metrics import GatewayMetrics
from services.frontend.engine_client.mesh_client import MeshClient
from services.frontend.engine_client.mesh_view import MeshView
from services.frontend.engine_client.request_run import RequestRun, new_request_id
from services.frontend.engine_client.request_stats import RequestTimer
from services.frontend.openai.lora_registry import LoraRegistry
from services.frontend.router.engine_router import EngineRouter
from services.frontend.settings import FrontendSettings


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

    def new_run(self, id_prefix: str, model: str) -> RequestRun:
        request_id = new_request_id(id_prefix)
        return RequestRun(self.client, self.view, request_id, self.settings.request_timeout_s,
                             RequestTimer(self.metrics, model, request_id), router=self.router,
                             engine_wait_s=self.settings.engine_wait_s, loras=self.loras)
