"""Moving a request that is running when its engine or tokenizer is lost.

The gateway keeps, for each generation, the request as first submitted and the output
tokens streamed so far (TextOutputBatch carries them). A move stops the request where it
ran (best effort), registers a continuation at a live tokenizer — its detokenizer state
replays the streamed tokens and knows how much text the client already has — and submits
the prompt plus the streamed tokens, with max_tokens reduced by as many, to a live engine.
The client's stream just continues: greedy output is what an undisturbed run gives.

Moves retry, every quarter second, while no engine or tokenizer is ready, for at most
--migration-timeout-s; then the request ends with a retriable error (503 / an SSE error
event). A request moved off a stalled engine (the stall watchdog, MeshClient.move_stalled)
counts that engine as not ready until it steps again: it goes to another ready engine, or
waits. A request that asked for prompt logprobs is not moved (the continuation's prompt
differs) and ends with that error at once.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol, TypeVar

import betterproto
import structlog

from services.common import wire
from services.common.bus import BusError
from services.common.metrics import GatewayMetrics
from services.common.packing import pack_int32
from services.frontend.engine_client.generation import Generation, is_movable
from services.frontend.engine_client.mesh_view import EngineView, MeshView
from services.frontend.errors import ApiError, unavailable

log = structlog.get_logger(__name__)

RETRY_INTERVAL_S = 0.25
M = TypeVar("M", bound=betterproto.Message)


class PlacementClient(Protocol):
    """What a move asks of the mesh client (mesh_client.MeshClient, which owns a Migrator)."""

    async def detach(self, generation: Generation) -> None: ...

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply: ...

    async def place(self, generation: Generation, engine: EngineView,
                    request: wire.GenerateRequest) -> None: ...

    async def release(self, tokenizer_id: str, request_ids: list[str]) -> None: ...

    def end(self, generation: Generation, finish: wire.FinishInfo) -> None: ...

    def finish_with_error(self, generation: Generation, message: str) -> None: ...


class Migrator:
    def __init__(self, client: PlacementClient, view: MeshView, timeout_s: float,
                 metrics: GatewayMetrics | None) -> None:
        self._client = client
        self._view = view
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def move(self, generations: list[Generation], reason: str,
             stalled_engine: str | None = None, away_from: str | None = None,
             to_engine: str | None = None) -> None:
        """Starts moving each generation (one already moving is left to that move), never
        back onto `away_from`; onto `to_engine` while it is a candidate, else the least
        loaded."""
        for generation in generations:
            if generation.moving or generation.finished:
                continue
            generation.moving = True
            task = asyncio.create_task(self._move(generation, reason, stalled_engine,
                                                  away_from, to_engine))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _move(self, generation: Generation, reason: str, stalled_engine: str | None,
                    away_from: str | None, to_engine: str | None) -> None:
        old_id, old_engine = generation.request_id, generation.engine_id
        try:
            await self._client.detach(generation)
            if not is_movable(generation):
                self._client.finish_with_error(
                    generation, f"{reason}; the request asked for prompt logprobs, so it "
                                f"cannot continue elsewhere: retry the request")
                return
            error = await self._place_until_deadline(generation, stalled_engine, away_from,
                                                     to_engine)
            if error is not None:
                self._count("failed")
                self._client.finish_with_error(generation, f"{reason} and no replacement took "
                                                           f"over: {error}; retry the request")
                return
            if generation.finished:          # the client went away during the move
                await self._client.detach(generation)
                return
            self._count("moved")
            log.info("request moved", request_id=old_id, new_request_id=generation.request_id,
                     from_engine=old_engine, to_engine=generation.engine_id, reason=reason,
                     num_streamed_tokens=len(generation.output_token_ids))
        finally:
            generation.moving = False

    async def _place_until_deadline(self, generation: Generation, stalled_engine: str | None,
                                    away_from: str | None, to_engine: str | None) -> str | None:
        """Places the continuation; None once it runs, else why it could not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        noticed = time.monotonic()
        while True:
            if generation.finished:
                return None
            # NOTE: not back onto the engine that hung while it holds work without a step
            # (it still says ready): the request would only stall there again.
            avoid = ([stalled_engine] if stalled_engine is not None
                     and not self._view.has_progressed(stalled_engine, noticed) else [])
            if away_from is not None:
                avoid.append(away_from)
            try:
                await self._place(generation, avoid, to_engine)
                return None
            except (ApiError, BusError) as exc:
                if isinstance(exc, ApiError) and exc.status != 503:
                    return exc.message
                if loop.time() + RETRY_INTERVAL_S > deadline:
                    return exc.message if isinstance(exc, ApiError) else str(exc)
            await asyncio.sleep(RETRY_INTERVAL_S)

    async def _place(self, generation: Generation, avoid: list[str],
                     to_engine: str | None) -> None:
        first = generation.request
        assert first is not None and generation.detokenize is not None
        needs_lora = first.lora is not None and first.lora.lora_id > 0
        engine = self._view.pick_engine(generation.model, avoid, needs_lora, prefer=to_engine)
        if engine is None:
            raise unavailable("no engine is ready", code="engine_unavailable")
        streamed = generation.output_token_ids
        remaining = first.sampling.max_tokens - len(streamed)
        if remaining < 1:   # it had finished; only the finish message was lost
            self._client.end(generation, wire.FinishInfo(
                request_id=generation.request_id, finish_reason=wire.FinishReason.LENGTH,
                num_output_tokens=len(streamed)))
            return
        request_id = f"{base_request_id(first.request_id)}.m{generation.num_moves + 1}"
        detokenize = _copy(generation.detokenize)
        detokenize.engine_id = engine.engine_id
        encoded = await self._client.encode(wire.EncodeRequest(
            prompt_token_ids=first.prompt_token_ids, request_ids=[request_id],
            detokenize=detokenize, resume_token_ids=pack_int32(streamed),
            resume_num_chars=generation.num_chars))
        sampling = _copy(first.sampling)
        sampling.max_tokens = remaining
        sampling.min_tokens = max(0, first.sampling.min_tokens - len(streamed))
        if sampling.grammar.kind != wire.GrammarKind.NONE:
            # The streamed tokens ride in the prompt; the worker replays them into a matcher.
            sampling.grammar.num_resumed_tokens = len(streamed)
        continuation = wire.GenerateRequest(
            request_id=request_id, prompt_token_ids=first.prompt_token_ids + pack_int32(streamed),
            sampling=sampling, priority=first.priority, cache_salt=first.cache_salt,
            tokenizer_id=encoded.tokenizer_id, arrival_time=first.arrival_time,
            lora=first.lora, mm_items=first.mm_items)
        if generation.deadline_at is not None:   # what is left of it, not a fresh one
            continuation.deadline_s = max(generation.deadline_at - time.monotonic(), 1e-3)
        try:
            await self._client.place(generation, engine, continuation)
        except BaseException:
            await self._client.release(encoded.tokenizer_id, [request_id])
            raise
        generation.num_moves += 1

    def _count(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.request_migrations.labels(outcome).inc()


def base_request_id(request_id: str) -> str:
    """The id a generation had before any move ('cmpl-ab12-0-0.m2' -> 'cmpl-ab12-0-0')."""
    return request_id.split(".m", 1)[0]


def _copy(message: M) -> M:
    return type(message)().parse(bytes(message))
