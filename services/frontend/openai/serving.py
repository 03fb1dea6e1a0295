"""The life of one generation request (chat or completions), shared by both endpoints, as
vLLM's OpenAIServing: start the run, then either collect every choice into one JSON response
or stream SSE chunks, with usage as `stream_options` asks. A subclass (serving_chat.py,
serving_completion.py) says how its choices look."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.logs import bind_request_id, request_log_context
from services.frontend.context import FrontendContext
from services.frontend.engine_client.generation import TextDelta
from services.frontend.engine_client.request_run import RequestPlan
from services.frontend.errors import invalid
from services.frontend.openai.choice_state import ChoiceState, error_of, usage
from services.frontend.openai.http_response import SSE_DONE, SSE_KEEPALIVE, sse, until_disconnect
from services.frontend.openai.protocol import (
    MAX_SESSION_ID_CHARS,
    ChatCompletionRequest,
    CompletionRequest,
)
from services.frontend.tenancy.auth import tenant_of

C = TypeVar("C", bound=ChoiceState)
Body = TypeVar("Body", ChatCompletionRequest, CompletionRequest)


class OpenAIServing(ABC, Generic[Body, C]):
    object_name: ClassVar[str]        # of the whole response
    chunk_object_name: ClassVar[str]  # of a streamed chunk
    id_prefix: ClassVar[str]

    def __init__(self, body: Body, ctx: FrontendContext) -> None:
        self.body = body
        self.ctx = ctx
        self.run = ctx.new_run(self.id_prefix, body.model)
        options = body.stream_options
        self._include_usage = bool(options is not None and options.include_usage)
        self._continuous_usage = self._include_usage and bool(
            options is not None and options.continuous_usage_stats)

    # ---- what a subclass provides

    @abstractmethod
    def plan(self) -> RequestPlan:
        """Validates the body into the prompts and parameters to run (400 on bad input)."""

    async def prepare(self) -> None:
        """Runs after the request was submitted, before any output is read."""

    @abstractmethod
    def new_choice(self, index: int) -> C:
        """The state one choice accumulates."""

    @abstractmethod
    def choice_json(self, index: int, choice: C) -> dict[str, Any]:
        """The finished choice, in the non-streamed response."""

    @abstractmethod
    def chunk_choice(self, index: int, choice: C, delta: TextDelta) -> dict[str, Any] | None:
        """The streamed chunk's choice for `delta` (already added to `choice`); None when
        the delta carries nothing a client would see."""

    def opening_chunk_choices(self, count: int) -> list[dict[str, Any]]:
        """Choices sent before any output (chat sends each choice's role first)."""
        return []

    def add(self, choice: C, delta: TextDelta) -> None:
        choice.add(delta)

    def response_extras(self, choices: list[C]) -> dict[str, Any]:
        """Fields of the non-streamed response beyond OpenAI's (vLLM's prompt_logprobs)."""
        return {}

    def opening_chunk_fields(self) -> dict[str, Any]:
        """Fields of the opening chunks beyond OpenAI's (chat: vLLM's prompt_token_ids)."""
        return {}

    def carries_token_ids(self, delta: TextDelta) -> bool:
        """Whether `delta`'s chunk must go out for its token ids alone (return_token_ids)."""
        return bool(self.body.return_token_ids and delta.token_ids)

    # ---- the shared life of a request

    async def respond(self, request: Request) -> JSONResponse | StreamingResponse:
        with request_log_context(self.run.request_id):
            plan = self.plan()
            plan.deadline_s = request_deadline_s(request, self.ctx.settings.request_deadline_s)
            plan.session_id = session_id(request, self.body.prompt_cache_key)
            await self.run.start(plan, tenant_of(request))
            try:
                await self.prepare()
            except BaseException:
                await self.run.close()
                raise
            if self.body.stream:
                return StreamingResponse(self._stream(), media_type="text/event-stream")
            return JSONResponse(await until_disconnect(request, self._collect(), self.run))

    def _new_choices(self) -> list[C]:
        return [self.new_choice(i) for i in range(len(self.run.generations))]

    async def _collect(self) -> dict[str, Any]:
        choices = self._new_choices()
        async for delta in self.run.deltas():
            if (error := error_of(delta)) is not None:
                raise error
            self.add(choices[delta.index], delta)
        choices_json = [self.choice_json(i, c) for i, c in enumerate(choices)]
        if self.body.return_token_ids:
            for choice_json, choice in zip(choices_json, choices):
                choice_json["token_ids"] = choice.token_ids
        return {"id": self.run.request_id, "object": self.object_name,
                "created": self.run.created, "model": self.body.model,
                "choices": choices_json,
                "usage": usage(self.run, choices), **self.response_extras(choices)}

    async def _stream(self) -> AsyncIterator[bytes]:
        bind_request_id(self.run.request_id)
        choices = self._new_choices()
        keepalive_s = self.ctx.settings.sse_keepalive_s
        try:
            for opening in self.opening_chunk_choices(len(choices)):
                yield sse(self._chunk([opening]) | self.opening_chunk_fields())
            last_sent = time.monotonic()
            async for delta in self.run.deltas_or_idle(keepalive_s):
                if delta is not None and (error := error_of(delta)) is not None:
                    yield sse(error.body())
                    break
                if delta is not None and (chunk := self._chunk_of(delta, choices)) is not None:
                    yield chunk
                    last_sent = time.monotonic()
                elif delta is None or 0 < keepalive_s <= time.monotonic() - last_sent:
                    # NOTE: a comment line, which SSE clients skip: proxies with idle
                    # timeouts cut a stream quiet this long (a long prefill, a move).
                    yield SSE_KEEPALIVE
                    last_sent = time.monotonic()
            else:
                if self._include_usage:
                    yield sse(self._chunk([], usage(self.run, choices)))
            yield SSE_DONE
        finally:
            await self.run.close()

    def _chunk_of(self, delta: TextDelta, choices: list[C]) -> bytes | None:
        """Adds `delta` to its choice; its SSE chunk, or None when it carries nothing a
        client would see."""
        choice = choices[delta.index]
        self.add(choice, delta)
        if (chunk_choice := self.chunk_choice(delta.index, choice, delta)) is None:
            return None
        if self.body.return_token_ids:
            chunk_choice["token_ids"] = delta.token_ids
        return sse(self._chunk([chunk_choice], usage(self.run, choices)
                               if self._continuous_usage else None))

    def _chunk(self, choices: list[dict[str, Any]],
               chunk_usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """A streamed chunk; with usage asked for, every chunk has the field (null but in
        the last chunk and with continuous usage stats), as OpenAI's client expects."""
        chunk: dict[str, Any] = {"id": self.run.request_id, "object": self.chunk_object_name,
                                 "created": self.run.created, "model": self.body.model,
                                 "choices": choices}
        if self._include_usage:
            chunk["usage"] = chunk_usage
        return chunk


DEADLINE_HEADER = "x-request-deadline-s"
SESSION_HEADER = "x-session-id"


def request_deadline_s(request: Request, server_deadline_s: float) -> float:
    """The request's deadline in seconds (0: none): the server's, or the X-Request-Deadline-S
    header's when that is shorter (a client may ask for less, never for more)."""
    header = request.headers.get(DEADLINE_HEADER)
    if header is None:
        return server_deadline_s
    try:
        asked = float(header)
    except ValueError:
        asked = math.nan
    if not (math.isfinite(asked) and asked > 0):
        raise invalid(f"the X-Request-Deadline-S header must be a positive number of seconds, "
                      f"got {header!r}", param="X-Request-Deadline-S")
    return min(asked, server_deadline_s) if server_deadline_s > 0 else asked



def session_id(request: Request, prompt_cache_key: str | None) -> str:
    """The conversation a request belongs to, for the router: the prompt_cache_key body
    field, else the X-Session-Id header ("": none)."""
    if prompt_cache_key:
        return prompt_cache_key
    header = request.headers.get(SESSION_HEADER, "")
    if len(header) > MAX_SESSION_ID_CHARS:
        raise invalid(f"the {SESSION_HEADER} header is longer than {MAX_SESSION_ID_CHARS} "
                      f"characters", param=SESSION_HEADER)
    return header
