"""/v1/responses: OpenAI's Responses API (services/frontend/openai/responses_api/), with
stored responses and background runs kept in JetStream (its response_store.py), so any gateway
replica answers `GET /v1/responses/{id}`, continues a conversation (`previous_response_id`)
and resumes a background response's stream (`?stream=true&starting_after=N`).

A stored response belongs to the API key that made it: another tenant's id answers the same
404 as a missing one. A background response runs in the gateway that accepted it, as a task
that outlives the client's connection; a cancel reaches it wherever it runs (a NATS
message to every gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from nats.aio.msg import Msg

from services.common.subjects import Subjects
from services.frontend.context import FrontendContext
from services.frontend.errors import ApiError, invalid
from services.frontend.openai.http_response import SSE_KEEPALIVE, list_page, until_disconnect
from services.frontend.openai.responses_api.items import input_messages
from services.frontend.openai.responses_api.protocol import ResponsesRequest
from services.frontend.openai.responses_api.response_output import Event
from services.frontend.openai.responses_api.response_run import ResponseRun
from services.frontend.openai.responses_api.response_store import ResponseRecord, ResponseStore
from services.frontend.openai.responses_api.resume import (
    Checkpoint,
    ResumeState,
    checkpoint_headers,
)
from services.frontend.tenancy.auth import owner_of
from services.gateway.body import parse_body
from services.gateway.storage_plane import StoragePlane

log = structlog.get_logger(__name__)

FINISHED = frozenset({"completed", "incomplete", "failed", "cancelled"})
CANCEL_WAIT_S = 5.0
FOLLOW_TICK_S = 1.0   # a follower's keep-alive, and its look at the running gateway


def sse_event(event: Event) -> bytes:
    """One event as OpenAI frames it: its type as the SSE event name, then the data."""
    return (f"event: {event['type']}\ndata: ".encode()
            + json.dumps(event, separators=(",", ":")).encode() + b"\n\n")


class Responses:
    """The routes' shared state: the store and the background runs this gateway holds."""

    def __init__(self, ctx: FrontendContext) -> None:
        self.ctx = ctx
        self.subjects = Subjects(ctx.settings.namespace)
        self._plane: StoragePlane[ResponseStore] = StoragePlane(
            ctx.settings, f"{ctx.client.gateway_id}-responses", ResponseStore.open, "responses")
        self._cancels_heard = False
        self.background: dict[str, tuple[ResponseRun, asyncio.Task[None]]] = {}

    async def store(self) -> ResponseStore:
        """The store, connected on first use; from then on this gateway hears cancels."""
        store = await self._plane.store()
        if not self._cancels_heard:
            self._cancels_heard = True
            assert self._plane.nats is not None
            await self._plane.nats.subscribe(self.subjects.response_cancel, cb=self._on_cancel)
        return store

    async def _on_cancel(self, message: Msg) -> None:
        self._cancel_here(message.data.decode())

    def _cancel_here(self, response_id: str) -> asyncio.Task[None] | None:
        """Cancels a background run of this gateway; its task (None: not here)."""
        if (entry := self.background.get(response_id)) is None:
            return None
        run, task = entry
        run.cancel_requested = True
        # NOTE: wakes the task if it waits for output; nats-py swallows a cancellation that
        # lands in a publish, and then the flag stops the run at its next event.
        task.cancel()
        return task

    async def record(self, request: Request, response_id: str,
                     param: str | None = None) -> ResponseRecord:
        """The caller's stored response; 404 for one missing or another tenant's alike."""
        record = await (await self.store()).get(response_id)
        if record is None or record.owner != owner_of(request):
            raise ApiError(404, f"Response with id '{response_id}' not found.", param=param,
                           code="response_not_found")
        return record

    async def keep(self, run: ResponseRun, owner: str) -> None:
        """Stores a finished foreground response; a store that cannot be reached costs the
        caller nothing but a later GET (logged). Background runs keep their own record."""
        try:
            await (await self.store()).put(run.id, ResponseRecord(
                owner, run.response(), run.conversation, run.output.messages(),
                run.input_items))
        except ApiError as exc:
            log.warning("response not stored", response_id=run.id, error=exc.message)

    # ---- POST /v1/responses

    async def create(self, request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest, self.ctx.settings.max_body_bytes)
        if body.background and not body.store:
            raise invalid("a background response is stored: set store to true",
                          param="background")
        history: list[dict[str, Any]] = []
        if body.previous_response_id:
            previous = await self.record(request, body.previous_response_id,
                                         param="previous_response_id")
            if previous.status not in ("completed", "incomplete"):
                raise invalid(f"response {body.previous_response_id!r} is {previous.status}; "
                              f"a conversation continues a finished response",
                              param="previous_response_id")
            history = previous.next_conversation()
        run = ResponseRun(body, self.ctx, history + input_messages(body))
        await run.start(request)
        owner = owner_of(request)
        if body.background:
            return await self._start_background(run, owner, body.stream)
        if body.stream:
            return StreamingResponse(self._stream(run, owner), media_type="text/event-stream")
        return JSONResponse(await until_disconnect(request, self._collect(run, owner), run))

    async def _collect(self, run: ResponseRun, owner: str) -> dict[str, Any]:
        async for _ in run.events():
            pass
        if run.failure is not None:
            raise run.failure
        if run.body.store:
            await self.keep(run, owner)
        return run.response()

    async def _stream(self, run: ResponseRun, owner: str) -> AsyncIterator[bytes]:
        async for event in run.events():
            yield sse_event(event)
        if run.body.store:
            await self.keep(run, owner)

    async def _start_background(self, run: ResponseRun, owner: str, stream: bool) -> Response:
        record = ResponseRecord(owner, run.response(), run.conversation,
                                input_items=run.input_items,
                                gateway=self.ctx.client.gateway_id,
                                body=run.body.model_dump(by_alias=True, exclude_none=True),
                                resume=run.resume_state().to_json())
        try:
            store = await self.store()
            await store.put(run.id, record)
        except BaseException:
            await run.close()
            raise
        self._run_in_background(run, record, store)
        if stream:
            return StreamingResponse(self._follow(owner, run.id, -1),
                                     media_type="text/event-stream")
        return JSONResponse(run.response())

    def _run_in_background(self, run: ResponseRun, record: ResponseRecord,
                           store: ResponseStore) -> None:
        task = asyncio.create_task(self._run_background(run, record, store))
        self.background[run.id] = (run, task)
        task.add_done_callback(lambda _: self.background.pop(run.id, None))

    async def _run_background(self, run: ResponseRun, record: ResponseRecord,
                              store: ResponseStore) -> None:
        """Runs the response to its end whoever listens, publishing every event with the
        checkpoints another gateway would resume it from; the record follows each change
        of status."""
        try:
            async with contextlib.aclosing(run.events()) as events:
                async for event in events:
                    if run.cancel_requested:
                        break
                    headers = checkpoint_headers(*run.checkpoint) if run.checkpoint else None
                    await store.publish_event(run.id, event, headers)
                    if "response" in event:
                        await self._update(store, run, record)
        except asyncio.CancelledError:
            if not run.cancel_requested:
                raise   # the gateway is stopping: another one resumes the run
        except Exception:
            log.exception("background response failed", response_id=run.id)
        if run.cancel_requested:
            await run.close()
            await store.publish_event(run.id, run.cancelled_event())
            await self._update(store, run, record)

    async def _update(self, store: ResponseStore, run: ResponseRun,
                      record: ResponseRecord) -> None:
        record.response = run.response()
        record.output_messages = run.output.messages()
        await store.put(run.id, record)

    async def _follow(self, owner: str, response_id: str,
                      starting_after: int) -> AsyncIterator[bytes]:
        """The response's events after `starting_after`; while none come, keep-alives and a
        look at whether the gateway running it is still there (if not, this one takes the
        run over)."""
        store = await self.store()
        async for event in store.follow(response_id, starting_after, idle_s=FOLLOW_TICK_S):
            if event is not None:
                yield sse_event(event)
                continue
            yield SSE_KEEPALIVE
            record = await store.get(response_id)
            if record is not None and record.owner == owner:
                await self._take_over_if_orphaned(store, record, response_id)

    async def _take_over_if_orphaned(self, store: ResponseStore, record: ResponseRecord,
                                     response_id: str) -> None:
        """Resumes here a background response whose gateway stopped (resume.py)."""
        gateway = self.ctx.client.gateway_id
        if (record.status in FINISHED or record.gateway in (gateway, "")
                or self.ctx.view.is_alive(record.gateway)
                or record.body is None or record.resume is None):
            return
        stopped = record.gateway
        if not await store.claim(response_id, record, gateway):
            return   # another gateway took it
        checkpoint = Checkpoint.of(await store.stored_events(response_id))
        resume = ResumeState(**record.resume)
        run = ResponseRun.resumed(ResponsesRequest.model_validate(record.body), self.ctx,
                                  record.conversation, record.response,
                                  resume.generation(gateway, checkpoint), checkpoint)
        log.info("resuming a background response whose gateway stopped",
                 response_id=response_id, stopped_gateway=stopped,
                 num_streamed_tokens=len(checkpoint.token_ids),
                 last_event=checkpoint.sequence)
        self.ctx.client.migrator.move([run.generation], "its gateway stopped")
        self._run_in_background(run, record, store)

    # ---- the stored response

    async def retrieve(self, request: Request, response_id: str) -> Response:
        record = await self.record(request, response_id)
        if request.query_params.get("stream", "false").lower() != "true":
            await self._take_over_if_orphaned(await self.store(), record, response_id)
            return JSONResponse(record.response)
        if not record.response.get("background"):
            raise invalid("only a background response can be streamed again", param="stream")
        try:
            starting_after = int(request.query_params.get("starting_after", "-1"))
        except ValueError:
            raise invalid("starting_after must be an event's sequence number",
                          param="starting_after") from None
        return StreamingResponse(self._follow(record.owner, response_id, starting_after),
                                 media_type="text/event-stream")

    async def cancel(self, request: Request, response_id: str) -> Response:
        record = await self.record(request, response_id)
        if not record.response.get("background"):
            raise invalid("only a background response can be cancelled")
        if record.status not in FINISHED:
            task = self._cancel_here(response_id)
            if task is not None:
                await asyncio.wait({task}, timeout=CANCEL_WAIT_S)
            else:   # another gateway runs it
                assert self._plane.nats is not None   # open: the record came from the store
                await self._plane.nats.publish(self.subjects.response_cancel,
                                               response_id.encode())
                await self._until_finished(request, response_id)
            record = await self.record(request, response_id)
        return JSONResponse(record.response)

    async def _until_finished(self, request: Request, response_id: str) -> None:
        """Waits, for at most CANCEL_WAIT_S, until the record says the run ended."""
        async def finished() -> None:
            while (await self.record(request, response_id)).status not in FINISHED:
                await asyncio.sleep(0.05)   # NOTE: a KV read; a cancel lands within a step

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished(), CANCEL_WAIT_S)

    async def input_items(self, request: Request, response_id: str, after: str | None = None,
                          limit: int = 20, order: str = "desc") -> dict[str, Any]:
        """The response's input items, a page at a time (OpenAI's cursor: `after` an id)."""
        if not 1 <= limit <= 100:
            raise invalid("limit must be between 1 and 100", param="limit")
        if order not in ("asc", "desc"):
            raise invalid("order must be asc or desc", param="order")
        items = (await self.record(request, response_id)).input_items
        if order == "desc":
            items = items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise invalid(f"no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1:]
        return list_page(items[:limit], has_more=len(items) > limit)

    async def delete(self, request: Request, response_id: str) -> dict[str, Any]:
        await self.record(request, response_id)
        await (await self.store()).delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def responses_router(ctx: FrontendContext) -> APIRouter:
    responses = Responses(ctx)
    router = APIRouter()
    router.add_api_route("/v1/responses", responses.create, methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"])
    router.add_api_route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"])
    router.add_api_route("/v1/responses/{response_id}/cancel", responses.cancel,
                         methods=["POST"])
    router.add_api_route("/v1/responses/{response_id}/input_items", responses.input_items,
                         methods=["GET"])
    return router
