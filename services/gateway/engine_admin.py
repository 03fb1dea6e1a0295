"""An admin command sent to every ready engine of the mesh at once, or to the one named by
?engine_id= (sleep mode's and weight updates' endpoints)."""

from __future__ import annotations

import asyncio
from typing import Any

from services.common import wire
from services.common.bus import BusError
from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError


def engines_to_command(ctx: FrontendContext, engine_id: str | None) -> list[str]:
    """The ready engines (or `engine_id`, if ready) an admin endpoint acts on."""
    engines = sorted({e.engine_id for e in ctx.view.ready_engines()})
    if engine_id is not None:
        if engine_id not in engines:
            raise ApiError(404, f"no ready engine {engine_id!r} (ready: {', '.join(engines)})",
                           param="engine_id", code="engine_not_found")
        engines = [engine_id]
    if not engines:
        raise ApiError(503, "no engine is ready", code="engine_unavailable", retry_after_s=1)
    return engines


async def command_engines(ctx: FrontendContext, engines: list[str], command: str,
                          timeout_s: float, **fields: Any) -> dict[str, wire.AdminReply]:
    """Every engine's reply to `command` (an unanswered call reads as a 503 reply)."""
    async def call(engine: str) -> wire.AdminReply:
        try:
            return await ctx.client.admin(engine, command, timeout_s=timeout_s, **fields)
        except BusError as exc:
            return wire.AdminReply(error=str(exc), http_status=503)

    return dict(zip(engines, await asyncio.gather(*(call(e) for e in engines)), strict=True))


def raise_failures(command: str, replies: dict[str, wire.AdminReply]) -> None:
    """The failed engines' errors as one OpenAI-style error (the worst status)."""
    failed = {e: r for e, r in replies.items() if not r.ok}
    if failed:
        status = max(r.http_status or 503 for r in failed.values())
        raise ApiError(status, "; ".join(f"engine {e}: {r.error}" for e, r in failed.items()),
                       code=f"{command}_failed", retry_after_s=1 if status == 503 else None)


async def each_engine(ctx: FrontendContext, engine_id: str | None, command: str,
                      timeout_s: float, **fields: Any) -> dict[str, wire.AdminReply]:
    """Sends `command` to every ready engine (or `engine_id`) at once; their replies, or the
    failures as an OpenAI-style error."""
    replies = await command_engines(ctx, engines_to_command(ctx, engine_id), command,
                                    timeout_s, **fields)
    raise_failures(command, replies)
    return replies
