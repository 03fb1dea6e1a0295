"""vLLM's sleep mode endpoints (engines started with --enable-sleep-mode; admin keys only
when API keys are set): POST /sleep?level=1|2, POST /wake_up?tags=weights&tags=kv_cache,
GET /is_sleeping. Each acts on every ready engine of the mesh at once, or on the one named
by ?engine_id=. While an engine sleeps it refuses requests with 503 + Retry-After (error
code engine_sleeping); the router sends them to an awake engine where there is one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from services.frontend.context import FrontendContext
from services.frontend.errors import invalid
from services.frontend.tenancy.auth import ApiKeys
from services.gateway.engine_admin import each_engine
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
        await each_engine(ctx, engine_id, "sleep", _SLEEP_TIMEOUT_S, level=level)
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(request: Request, tags: list[str] | None = Query(None),
                      engine_id: str | None = None) -> Response:
        require_admin(api_keys, request)
        await each_engine(ctx, engine_id, "wake_up", _SLEEP_TIMEOUT_S, tags=tags or [])
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping(request: Request, engine_id: str | None = None) -> dict[str, Any]:
        """vLLM's answer, {"is_sleeping": bool}: true while any engine asked sleeps; with
        each engine's own state beside it."""
        require_admin(api_keys, request)
        replies = await each_engine(ctx, engine_id, "is_sleeping", _SLEEP_TIMEOUT_S)
        return {"is_sleeping": any(r.is_sleeping for r in replies.values()),
                "engines": {e: r.is_sleeping for e, r in sorted(replies.items())}}

    return router
