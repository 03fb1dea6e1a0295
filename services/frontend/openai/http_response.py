"""HTTP framing every endpoint shares: SSE events, OpenAI list pages, and running a handler
until the client disconnects (then aborting what it started)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

from fastapi import Request

from services.frontend.errors import ApiError

T = TypeVar("T")


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """One page of an OpenAI list (files, batches, input items): its cursor is an id."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


class Closable(Protocol):
    async def close(self) -> None: ...


async def until_disconnect(request: Request, work: Awaitable[T], run: Closable) -> T:
    """Runs `work`; if the client disconnects first, aborts the run and raises."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        raise ApiError(499, "client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await run.close()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
