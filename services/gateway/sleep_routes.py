"""vLLM's sleep mode endpoints (engines started with --enable-sleep-mode; admin keys only
when API keys are set): POST /sleep?level=1|2, POST /wake_up?tags=weights&tags=kv_cache,
GET /is_sleeping. Each acts on every ready engine of the mesh at once, or on the one named
by ?engine_id=. While an engine sleeps it refuses requests with 503 + Retry-After (error
code engine_sleeping); the router sends them to an awake engine where there is one."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from services.common import wire
from services.common.bus import BusError
from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid
from services.frontend.tenancy.auth import ApiKeys
from services.gateway.lora_routes import require_admin

# A sleep first lets the engine's requests in flight finish; a level-2 wake-up reads the
# whole checkpoint again.
_SLEEP_TIMEOUT_S = 600.0


def sleep_router(ctx: FrontendContext, api_keys: ApiKeys) -> APIRouter:
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(request: Request, level: int = 1, engine_id: str | None = None) -> Response:
        require_admin(api_keys, request)
        if level not in (1, 2):
            raise invalid(f"level must be 1 or 2, not {level}", param="level")
        await _each_engine(ctx, engine_id, "sleep", level=level)
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(request: Request, tags: list[str] | None = Query(None),
                      engine_id: str | None = None) -> Response:
        require_admin(api_keys, request)
        await _each_engine(ctx, engine_id, "wake_up", tags=tags or [])
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request, engine_id: str | None = None) -> dict[str, Any]:
        """vLLM's answer, {"is_sleeping": bool}: true while any engine asked sleeps; with
        each engine's own state beside it."""
        require_admin(api_keys, request)
        replies = await _each_engine(ctx, engine_id, "is_sleeping")
        return {"is_sleeping": any(r.is_sleeping for r in replies.values()),
                "engines": {e: r.is_sleeping for e, r in sorted(replies.items())}}

    return router


async def _each_engine(ctx: FrontendContext, engine_id: str | None, command: str, *,
                       level: int = 0, tags: list[str] | None = None) -> dict[str, wire.AdminReply]:
    """Sends `command` to every ready engine (or `engine_id`) at once; their replies, or the
    first failure as an OpenAI-style error."""
    engines = sorted({e.engine_id for e in ctx.view.ready_engines()})
    if engine_id is not None:
        if engine_id not in engines:
            raise ApiError(404, f"no ready engine {engine_id!r} (ready: {', '.join(engines)})",
                           param="engine_id", code="engine_not_found")
        engines = [engine_id]
    if not engines:
        raise ApiError(503, "no engine is ready", code="engine_unavailable", retry_after_s=1)

    async def call(engine: str) -> wire.AdminReply:
        try:
            return await ctx.client.admin(engine, command, level=level, tags=tags or (),
                                          timeout_s=_SLEEP_TIMEOUT_S)
        except BusError as exc:
            return wire.AdminReply(error=str(exc), http_status=503)

    replies = dict(zip(engines, await asyncio.gather(*(call(e) for e in engines)), strict=True))
    failed = {e: r for e, r in replies.items() if not r.ok}
    if failed:
        status = max(r.http_status or 503 for r in failed.values())
        raise ApiError(status, "; ".join(f"engine {e}: {r.error}" for e, r in failed.items()),
                       code=f"{command}_failed", retry_after_s=1 if status == 503 else None)
    return replies
