"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(admin keys only when API keys are set). Adapters load into this gateway's registry
(services/frontend/openai/lora_registry.py); an engine's worker reads one the first time a
request names it."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid
from services.frontend.openai.lora_registry import LoraModule, check_adapter_dir
from services.frontend.tenancy.auth import ApiKeys, tenant_of
from services.gateway.body import parse_body


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str
    base_model_name: str = ""


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str


def require_admin(api_keys: ApiKeys, request: Request) -> None:
    if not api_keys.may_administer(tenant_of(request)):
        raise ApiError(403, "this endpoint needs an admin API key (--admin-api-key)",
                       code="permission_denied")


def lora_router(ctx: FrontendContext, api_keys: ApiKeys) -> APIRouter:
    router = APIRouter()
    max_body_bytes = ctx.settings.max_body_bytes

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        require_admin(api_keys, request)
        body = await parse_body(request, LoadLoraAdapterRequest, max_body_bytes)
        if not body.lora_name or not body.lora_path:
            raise invalid("both lora_name and lora_path must be given", param="lora_name")
        if body.lora_name in ctx.view.models():
            raise invalid(f"'{body.lora_name}' is a base model's name", param="lora_name")
        check_adapter_dir(body.lora_path)
        ctx.loras.add(LoraModule(body.lora_name, body.lora_path, body.base_model_name))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        require_admin(api_keys, request)
        body = await parse_body(request, UnloadLoraAdapterRequest, max_body_bytes)
        ctx.loras.remove(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")

    return router
