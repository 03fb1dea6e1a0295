"""Runs one batch line through the gateway's own request path, in process.

The line's body goes through the very handler an HTTP request reaches (validation, prompt
encoding, engine choice, sampling parameters, response assembly), so a batch line answers
exactly what the same body POSTed to the gateway answers — only at the batch's priority.
It runs as the batch owner's tenant, as that key's own request would: the tenant's
prefix-cache salt, and its token bucket pays for the line.
Failures the mesh may recover from (no engine ready, queue full, the key's rate limit, an
engine or tokenizer lost mid-request) are retried with backoff, never sooner than their
Retry-After; the rest become the line's error response.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import Request
from pydantic import ValidationError

from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid
from services.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.frontend.openai.serving_chat import ChatCompletion
from services.frontend.openai.serving_completion import Completion
from services.frontend.tenancy.auth import Tenant

log = structlog.get_logger(__name__)

HANDLERS: dict[str, tuple[type[ChatCompletionRequest] | type[CompletionRequest],
                          type[ChatCompletion] | type[Completion]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion),
    "/v1/completions": (CompletionRequest, Completion),
}
RETRIABLE_STATUSES = frozenset({429, 500, 502, 503, 504})
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 5.0
STOP_CHECK_S = 0.25


@dataclass
class LineOutcome:
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineExecutor:
    def __init__(self, ctx: FrontendContext, priority: int, retry_for_s: float) -> None:
        self._ctx = ctx
        self._priority = priority
        self._retry_for_s = retry_for_s

    async def run(self, endpoint: str, body: dict[str, Any], tenant: Tenant | None,
                  should_stop: Callable[[], bool]) -> LineOutcome | None:
        """The line's response, run as `tenant` (None: no tenant, as a request that did not
        come through the gateway's auth); None when `should_stop` turned true while it waited
        to retry (the line then has no result and runs again later)."""
        deadline = time.monotonic() + self._retry_for_s
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                return await self._run_once(endpoint, body, tenant)
            except ApiError as exc:
                error = exc
            except Exception as exc:  # noqa: BLE001 - NATS trouble; the line is retried
                log.warning("batch line failed; retrying", error=str(exc) or type(exc).__name__)
                error = ApiError(500, f"internal error: {exc}")
            # A refusal's Retry-After (a key's rate limit, a full queue) is when trying again
            # can succeed: no sooner than that.
            wait_s = max(backoff, error.retry_after_s or 0.0)
            if error.status not in RETRIABLE_STATUSES or time.monotonic() + wait_s > deadline:
                return LineOutcome(error.status, "", error.body())
            if await _stopped_while_waiting(wait_s, should_stop):
                return None
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _run_once(self, endpoint: str, body: dict[str, Any],
                        tenant: Tenant | None) -> LineOutcome:
        request_type, handler_type = HANDLERS[endpoint]
        try:
            request = request_type.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise invalid(f"{param}: {first['msg']}" if param else first["msg"],
                          param=param) from None
        request.priority = self._priority
        request.stream = False  # a batch line's response is one JSON object
        request.stream_options = None
        handler = handler_type(request, self._ctx)  # type: ignore[arg-type]
        response = await handler.respond(_detached_request(endpoint, tenant))
        return LineOutcome(response.status_code, handler.run.request_id,
                           json.loads(bytes(response.body)))


async def _stopped_while_waiting(wait_s: float, should_stop: Callable[[], bool]) -> bool:
    """Waits `wait_s`, looking at `should_stop` every STOP_CHECK_S so a drain is not held
    up by a long Retry-After; True when it turned true."""
    until = time.monotonic() + wait_s
    while (left := until - time.monotonic()) > 0:
        if should_stop():
            return True
        await asyncio.sleep(min(left, STOP_CHECK_S))
    return should_stop()


def _detached_request(path: str, tenant: Tenant | None) -> Request:
    """An HTTP request with no client behind it: it never disconnects, so the handler
    always runs to its response. Its state holds the tenant where the auth middleware puts
    an HTTP request's (auth.tenant_of reads it)."""
    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    return Request({"type": "http", "method": "POST", "path": path, "headers": [],
                    "state": {"tenant": tenant}}, receive)
