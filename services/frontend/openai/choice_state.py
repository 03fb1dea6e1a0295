"""What completions and chat responses share: choice accumulation, usage, finish reasons,
SSE framing, and running a handler until the client disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from fastapi import Request

from services.common import wire
from services.frontend.engine_client.mesh_client import TextDelta
from services.frontend.engine_client.request_run import GenerationRun
from services.frontend.errors import ApiError, deadline_exceeded, invalid, unavailable

T = TypeVar("T")

FINISH_REASON_NAMES = {
    wire.FinishReason.STOP: "stop",
    wire.FinishReason.LENGTH: "length",
    wire.FinishReason.ABORT: "abort",
}


@dataclass
class ChoiceState:
    """One choice's output as it arrives."""
    text_parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish: wire.FinishInfo | None = None

    def add(self, delta: TextDelta) -> None:
        self.text_parts.append(delta.text)
        self.num_tokens += delta.num_new_tokens
        if delta.finish is not None:
            self.finish = delta.finish

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


def finish_reason(finish: wire.FinishInfo | None) -> str | None:
    return None if finish is None else FINISH_REASON_NAMES.get(finish.finish_reason)


def stop_reason(finish: wire.FinishInfo | None) -> str | int | None:
    """vLLM's extra field: the stop string or stop token id that ended the choice."""
    if finish is None or finish.finish_reason != wire.FinishReason.STOP:
        return None
    if finish.stop_reason:
        return finish.stop_reason
    return finish.stop_token_id


def error_of(delta: TextDelta) -> ApiError | None:
    if delta.finish is not None and delta.finish.finish_reason == wire.FinishReason.ERROR:
        code = delta.finish.error_code
        if code == "invalid_request":    # its own input (a grammar no token continues)
            return invalid(f"the request cannot be completed: {delta.finish.error}")
        if code == "deadline_exceeded":
            return deadline_exceeded()
        return unavailable(delta.finish.error or "the engine failed the request",
                           code="engine_error")
    return None


def usage(run: GenerationRun, choices: list[ChoiceState]) -> dict[str, Any]:
    completion_tokens = sum(c.num_tokens for c in choices)
    cached = max((c.finish.num_cached_tokens for c in choices if c.finish), default=0)
    return {"prompt_tokens": run.num_prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": run.num_prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


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
