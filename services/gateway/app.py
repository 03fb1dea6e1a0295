"""The FastAPI app: routes, auth, body limits and OpenAI-style errors."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common import wire
from services.common.bus import BusError
from services.common.jetstream import is_transient
from services.common.packing import pack_int32, unpack_int32
from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid, unavailable
from services.frontend.openai.lora_registry import LoraRegistry
from services.frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.frontend.openai.serving_chat import chat_prompt, create_chat_completion
from services.frontend.openai.serving_completion import create_completion
from services.frontend.tenancy.auth import ApiKeys
from services.gateway.authentication import Authentication
from services.gateway.body import parse_body
from services.gateway.engine_series import EngineSeries
from services.gateway.files_batches import files_batches_router
from services.gateway.lora_routes import lora_router, require_admin
from services.gateway.responses_api_routes import responses_router
from services.gateway.sleep_routes import sleep_router
from services.gateway.weight_routes import weight_router

log = structlog.get_logger(__name__)
VERSION = "0.1.0"


def create_app(ctx: FrontendContext, registry: CollectorRegistry,
               engine_series: EngineSeries | None = None) -> FastAPI:
    """`engine_series`: every engine's own families on /metrics (the gateway service's)."""
    app = FastAPI(title="LLM Mesh", version=VERSION, docs_url=None, redoc_url=None)
    settings = ctx.settings
    api_keys = ApiKeys.from_settings(settings, settings.namespace)
    app.state.api_keys = api_keys   # the service closes its Redis client at exit

    app.add_middleware(Authentication, api_keys=api_keys, on_rejected=ctx.metrics.rejections
                       .labels("401", "invalid_api_key").inc)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, exc: ApiError) -> Response:
        ctx.metrics.rejections.labels(str(exc.status), exc.code or "").inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return ApiError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(nats.errors.Error)
    async def on_nats_error(request: Request, exc: nats.errors.Error) -> Response:
        # A request that may succeed when retried gets 503 + Retry-After, not a 500.
        if not is_transient(exc):
            return await on_unexpected(request, exc)
        log.warning("NATS did not answer; the client may retry", path=request.url.path,
                    error=repr(exc))
        error = unavailable("NATS or JetStream is not answering (a node may be failing "
                            "over); retry shortly", code="nats_unavailable")
        return await on_api_error(request, error)

    @app.exception_handler(Exception)
    async def on_unexpected(_: Request, exc: Exception) -> Response:
        log.exception("request failed", error=str(exc))
        return ApiError(500, "internal error; see the gateway log").response()

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        models = ctx.view.models()
        served = [{"id": name, "object": "model", "created": 0, "owned_by": "llm-mesh",
                   "root": name, "parent": None, "max_model_len": max_len}
                  for name, max_len in sorted(models.items())]
        adapters = []
        for module in ctx.loras:   # vLLM lists an adapter with its path and its base model
            parent = LoraRegistry.parent(module, list(models)) or None
            adapters.append({"id": module.name, "object": "model", "created": 0,
                             "owned_by": "llm-mesh", "root": module.path, "parent": parent,
                             "max_model_len": models.get(parent or "")})
        return {"object": "list", "data": served + adapters}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await parse_body(request, CompletionRequest, settings.max_body_bytes)
        return await create_completion(body, ctx, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await parse_body(request, ChatCompletionRequest, settings.max_body_bytes)
        return await create_chat_completion(body, ctx, request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, TokenizeRequest, settings.max_body_bytes)
        message = wire.EncodeRequest(add_special_tokens=body.add_special_tokens,
                                     return_token_strings=body.return_token_strs)
        if body.messages is not None:
            prompt = chat_prompt(ChatCompletionRequest(model=body.model or "",
                                                       messages=body.messages,
                                                       tools=body.tools))
            assert prompt.chat is not None
            message.chat = prompt.chat
            message.tools_json = prompt.tools_json
            message.add_generation_prompt = body.add_generation_prompt
            message.continue_final_message = body.continue_final_message
        elif body.prompt is not None:
            message.prompt = body.prompt
        else:
            raise invalid("set prompt or messages", param="prompt")
        reply = await ctx.client.encode(message)
        tokens = unpack_int32(reply.token_ids).tolist()
        result: dict[str, Any] = {"count": len(tokens), "tokens": tokens,
                                  "max_model_len": max(ctx.view.models().values(), default=0)}
        if body.return_token_strs:
            result["token_strs"] = reply.token_strings
        return result

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await parse_body(request, DetokenizeRequest, settings.max_body_bytes)
        return {"prompt": await ctx.client.detokenize(pack_int32(body.tokens))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        require_admin(api_keys, request)
        return await _reset_prefix_cache(ctx)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/health")
    async def health() -> Response:
        ok, detail = ctx.view.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", "services": detail},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = (generate_latest(registry) if engine_series is None
                else await engine_series.exposition(registry))
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    app.include_router(files_batches_router(ctx))
    app.include_router(responses_router(ctx))
    app.include_router(lora_router(ctx, api_keys))
    app.include_router(sleep_router(ctx, api_keys))
    app.include_router(weight_router(ctx, api_keys))
    return app


async def _reset_prefix_cache(ctx: FrontendContext) -> Response:
    engines = ctx.view.ready_engines()
    if not engines:
        raise ApiError(503, "no engine is ready", code="engine_unavailable", retry_after_s=1)

    async def reset(engine_id: str) -> str:
        try:
            reply = await ctx.client.admin(engine_id, "reset_prefix_cache")
        except BusError as exc:
            return f"{engine_id}: {exc}"
        return "" if reply.ok else f"{engine_id}: {reply.error}"

    errors = [e for e in await asyncio.gather(*(reset(e.engine_id) for e in engines)) if e]
    if errors:
        raise ApiError(503, "; ".join(errors), code="reset_failed", retry_after_s=1)
    return Response(status_code=200)
