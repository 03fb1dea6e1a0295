"""The gateway's side of the request path: encode with a tokenizer, submit to an engine,
receive text outputs, abort, and move requests whose tokenizer or engine is gone (or whose
messages a NATS reconnect may have lost) to live ones (migration.py)."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import structlog

from services.common import wire, wire_pb
from services.common.bus import Bus, BusError, NoResponders, RequestTimeout
from services.common.metrics import GatewayMetrics
from services.common.packing import unpack_int32, unpack_strings, unpack_uint8
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks
from services.frontend.engine_client.generation import Generation, TextDelta, is_movable
from services.frontend.engine_client.mesh_view import EngineView, Instance, MeshView
from services.frontend.engine_client.migration import Migrator
from services.frontend.errors import ApiError, unavailable

log = structlog.get_logger(__name__)
_SETTLE_AFTER_RECONNECT_S = 1.0


# (candidate engines, a request) -> engine id -> leading prompt tokens it holds
CachedTokens = Callable[[Sequence[EngineView], wire.GenerateRequest], dict[str, int]]


def num_prompt_tokens(request: wire.GenerateRequest) -> int:
    return len(request.prompt_token_ids) // 4   # packed int32


def queue_move_target(here: EngineView, with_room: Sequence[EngineView], num_prompt: int,
                      cached: dict[str, int]) -> EngineView | None:
    """Where a request queued on `here` should go, if anywhere: the engine with room whose
    prefill work — tokens queued or mid-prefill there, plus the prompt's tokens it does not
    hold — is least, when that is less than here's (its queue, which counts this prompt,
    less what here holds of it). Prefill tokens stand for time: every engine prefills at
    about the same rate. A queue bound by sequence slots (every one taken) has no such
    bound: it waits for a request to end, so any engine with room is sooner."""
    if not with_room:
        return None

    def work_there(engine: EngineView) -> int:
        return (engine.num_waiting_tokens + engine.num_running_prefill_tokens
                + num_prompt - cached.get(engine.engine_id, 0))

    best = min(with_room, key=lambda e: (work_there(e), e.load, e.engine_id))
    if here.max_num_seqs and here.num_running >= here.max_num_seqs:
        return best
    work_here = (here.num_waiting_tokens + here.num_running_prefill_tokens
                 - cached.get(here.engine_id, 0))
    return best if work_there(best) < work_here else None


class MeshClient:
    def __init__(self, bus: Bus, subjects: Subjects, gateway_id: str, view: MeshView,
                 tokenizer_timeout_s: float, submit_timeout_s: float, *,
                 migration_timeout_s: float = 30.0,
                 metrics: GatewayMetrics | None = None) -> None:
        self._bus = bus
        self._subjects = subjects
        self.gateway_id = gateway_id
        self._view = view
        self._tokenizer_timeout_s = tokenizer_timeout_s
        self._submit_timeout_s = submit_timeout_s
        self._generations: dict[str, Generation] = {}
        self._reconnects: dict[str, int] = {}    # instance id -> NATS reconnects it reported
        self._metrics = metrics
        self.migrator = Migrator(self, view, migration_timeout_s, metrics)

    async def start(self, tasks: BackgroundTasks) -> None:
        await self._bus.subscribe(self._subjects.gateway_outputs(self.gateway_id),
                                  wire_pb.TextOutputBatch, self._on_outputs)
        tasks.spawn(self._watch_own_connection(), name="watch own NATS connection")

    @property
    def generations(self) -> list[Generation]:
        return list(self._generations.values())

    def reconnects_of(self, instance_id: str) -> int:
        return self._reconnects.get(instance_id, 0)

    # ---- tokenizer calls

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        reply = await self._call_tokenizer(self._subjects.tokenizer_encode, request,
                                           wire.EncodeReply)
        if reply.error:
            raise ApiError(400, reply.error, param=reply.error_param or None)
        return reply

    async def detokenize(self, token_ids: bytes) -> str:
        reply = await self._call_tokenizer(self._subjects.tokenizer_detokenize,
                                           wire.DetokenizeRequest(token_ids=token_ids),
                                           wire.DetokenizeReply)
        if reply.error:
            raise ApiError(400, reply.error, param="tokens")
        return reply.text

    async def _call_tokenizer(self, subject: str, message, reply_type):  # type: ignore[no-untyped-def]
        try:
            return await self._bus.request(subject, message, reply_type,
                                           timeout=self._tokenizer_timeout_s)
        except NoResponders as exc:
            raise unavailable("no tokenizer is running", code="tokenizer_unavailable") from exc
        except BusError as exc:
            raise unavailable(f"the tokenizer did not answer: {exc}",
                              code="tokenizer_unavailable") from exc

    async def release(self, tokenizer_id: str, request_ids: list[str]) -> None:
        if request_ids:
            await self._bus.publish(self._subjects.tokenizer_release(tokenizer_id),
                                    wire.ReleaseRequest(request_ids=request_ids))

    # ---- engine calls

    async def submit(self, engine: EngineView, request: wire.GenerateRequest, index: int,
                     queue: asyncio.Queue[TextDelta], *, model: str = "",
                     detokenize: wire.DetokenizeParams | None = None) -> Generation:
        generation = Generation(request.request_id, index, engine.engine_id,
                                engine.scheduler_id, request.tokenizer_id, queue,
                                request=request, detokenize=detokenize, model=model)
        if request.deadline_s > 0:
            generation.deadline_at = time.monotonic() + request.deadline_s
        await self.place(generation, engine, request)
        return generation

    async def place(self, generation: Generation, engine: EngineView,
                    request: wire.GenerateRequest) -> None:
        """Submits `request` for `generation` to `engine`; on success the generation runs
        there under the request's id (a move gives it a new one)."""
        # Registered before sending: outputs may arrive before the submit reply does.
        engine_id = engine.engine_id
        generation.request_id = request.request_id
        generation.engine_id, generation.scheduler_id = engine_id, engine.scheduler_id
        generation.tokenizer_id = request.tokenizer_id
        generation.placed_at = generation.last_output_at = time.monotonic()
        generation.placed_reconnects = {i: self.reconnects_of(i) for i in
                                        (engine.scheduler_id, request.tokenizer_id)}
        self._generations[request.request_id] = generation
        self._view.track(engine_id, +1)
        try:
            reply = await self._bus.request(self._subjects.engine_submit(engine_id), request,
                                            wire.SubmitReply, timeout=self._submit_timeout_s)
        except BusError as exc:
            self._unregister(generation)
            if isinstance(exc, RequestTimeout):   # it may have been accepted after all
                await self._abort_in_engine(engine_id, [request.request_id])
            raise unavailable(f"engine {engine_id} did not accept the request: {exc}",
                              code="engine_unavailable") from exc
        if not reply.accepted:
            self._unregister(generation)
            raise ApiError(reply.http_status or 503, reply.error, code=reply.error_code or None,
                           retry_after_s=reply.retry_after_s or None)
        if reply.scheduler_id and reply.scheduler_id != generation.scheduler_id:
            # The view still listed an instance of this engine that has been replaced (a
            # restart, not yet swept): the request's state lives in the one that replied.
            generation.placed_reconnects[reply.scheduler_id] = self.reconnects_of(
                reply.scheduler_id)
            generation.scheduler_id = reply.scheduler_id

    async def admin(self, engine_id: str, command: str, *, level: int = 0,
                    tags: Sequence[str] = (), model_path: str = "", weight_version: str = "",
                    timeout_s: float | None = None) -> wire.AdminReply:
        """An admin command to one engine's scheduler; `level` and `tags` are sleep mode's,
        `model_path` and `weight_version` weight updates'."""
        message = wire.AdminRequest(command=command, level=level, tags=list(tags),
                                    model_path=model_path, weight_version=weight_version)
        return await self._bus.request(self._subjects.engine_admin(engine_id), message,
                                       wire.AdminReply,
                                       timeout=timeout_s or self._submit_timeout_s)

    async def abort(self, generations: list[Generation]) -> None:
        """Stops unfinished generations in their engines and drops their tokenizer state."""
        by_engine: dict[str, list[str]] = defaultdict(list)
        by_tokenizer: dict[str, list[str]] = defaultdict(list)
        for generation in generations:
            if generation.finished:
                continue
            self._forget(generation)   # a generation being moved is not registered now
            generation.finished = True
            by_engine[generation.engine_id].append(generation.request_id)
            by_tokenizer[generation.tokenizer_id].append(generation.request_id)
        for engine_id, ids in by_engine.items():
            await self._abort_in_engine(engine_id, ids)
        for tokenizer_id, ids in by_tokenizer.items():
            await self.release(tokenizer_id, ids)

    async def _abort_in_engine(self, engine_id: str, request_ids: list[str]) -> None:
        await self._bus.publish(self._subjects.engine_abort(engine_id),
                                wire.AbortRequest(request_ids=request_ids,
                                                  reason=wire.FinishReason.ABORT))

    async def detach(self, generation: Generation) -> None:
        """Stops a generation where it runs now, without ending it (it is being moved).
        Best effort: the engine or tokenizer may be gone, or NATS down for a moment."""
        self._unregister(generation)
        try:
            await self._abort_in_engine(generation.engine_id, [generation.request_id])
            await self.release(generation.tokenizer_id, [generation.request_id])
        except Exception as exc:  # noqa: BLE001 - a reconnecting client refuses publishes
            log.debug("could not stop a moved request where it ran", error=str(exc))

    def fail_instance(self, instance: Instance) -> int:
        """Moves every generation whose state lived in a tokenizer or scheduler that is gone
        to live ones, or ends it with a retriable error. (A lost worker is its scheduler's
        business: it keeps its requests until the worker returns.)"""
        lost = [g for g in self._generations.values()
                if instance.instance_id in (g.tokenizer_id, g.scheduler_id)]
        self.migrator.move(lost, f"the {instance.service} serving it stopped")
        return len(lost)

    def move_stalled(self) -> int:
        """The stall watchdog, run with the heartbeat sweep: moves each generation that had
        no output for --stall-timeout-s while its engine made no progress (MeshView's rule),
        to another engine if one is ready. With the move's own bound, a stream ends within
        the stall timeout + --migration-timeout-s of its last progress, whatever hangs."""
        stalled = [g for g in self._generations.values() if not g.moving
                   and self._view.is_request_stalled(g.engine_id, g.last_output_at)]
        now = self._view.clock()
        for generation in stalled:
            log.warning("request stalled; moving it", request_id=generation.request_id,
                        engine=generation.engine_id,
                        silent_s=round(now - generation.last_output_at, 1))
            if self._metrics is not None:
                self._metrics.request_stalls.inc()
            self.migrator.move([generation], "engine stalled", stalled_engine=generation.engine_id)
        return len(stalled)

    def move_queued(self, after_s: float, busy_threshold: float,
                    cached_tokens: CachedTokens | None = None) -> int:
        """Moves a generation still without its first token `after_s` after it was placed,
        on an engine with a queue, to an engine where it would start at once, with KV room
        below `busy_threshold`, when its prefill would end sooner there (queue_move_target;
        `cached_tokens` says what each engine holds of a prompt): one slow or busy engine
        cannot hold requests the others could serve, and a long history cached where it
        waits is not recomputed elsewhere for nothing. At most one per engine with room per
        sweep, so a queue is not moved whole onto one engine; and once per request: the
        gateway cannot tell a request still queued from one part-way through a long prefill,
        and moving that one again throws the prefill away (measured past capacity: turns
        moved two and three times, each recomputing a 3,000-token history)."""
        if after_s <= 0:
            return 0
        now = time.monotonic()
        moved = 0
        for generation in list(self._generations.values()):
            if (generation.moving or generation.finished or generation.output_token_ids
                    or generation.queue_moved or now - generation.placed_at < after_s
                    or not is_movable(generation)):
                continue
            engines = self._view.candidate_engines(generation.model)
            here = next((e for e in engines if e.engine_id == generation.engine_id), None)
            with_room = [e for e in engines if e.engine_id != generation.engine_id
                         and e.has_room(busy_threshold)]
            if here is None or here.num_waiting == 0 or len(with_room) <= moved:
                continue
            assert generation.request is not None   # is_movable
            cached = (cached_tokens([here, *with_room], generation.request)
                      if cached_tokens is not None else {})
            target = queue_move_target(here, with_room, num_prompt_tokens(generation.request),
                                       cached)
            if target is None:
                continue
            log.info("request queued past the bound; moving it",
                     request_id=generation.request_id, engine=generation.engine_id,
                     to_engine=target.engine_id, queued_s=round(now - generation.placed_at, 1))
            generation.queue_moved = True
            self.migrator.move([generation], "queued behind a busy engine",
                               away_from=generation.engine_id, to_engine=target.engine_id)
            moved += 1
        return moved

    async def on_heartbeat(self, beat: wire.Heartbeat) -> None:
        """Each heartbeat (the runtime subscribes for both). An instance that reconnected to
        NATS may have lost messages of the generations placed on it before: move them (they
        continue from what this gateway received)."""
        previous = self._reconnects.get(beat.instance_id)
        self._reconnects[beat.instance_id] = beat.reconnects
        if previous is None or beat.reconnects == previous:
            return
        bounced = [g for g in self._generations.values()
                   if g.placed_reconnects.get(beat.instance_id, beat.reconnects)
                   < beat.reconnects]
        self.migrator.move(bounced, f"the {beat.service} reconnected to NATS")

    async def _watch_own_connection(self) -> None:
        """This gateway's own reconnect: outputs or aborts may have been lost."""
        seen = self._bus.reconnects
        while True:
            await asyncio.sleep(0.25)
            if self._bus.reconnects == seen:
                continue
            seen = self._bus.reconnects
            noticed = time.monotonic()
            # NOTE: give the other services a moment to reconnect too (a NATS restart
            # drops everyone); moves placed after this moment are not affected.
            await asyncio.sleep(_SETTLE_AFTER_RECONNECT_S)
            self.migrator.move([g for g in self._generations.values() if g.placed_at < noticed],
                               "this gateway reconnected to NATS")

    def finish_with_error(self, generation: Generation, message: str) -> None:
        self.end(generation, wire.FinishInfo(request_id=generation.request_id,
                                             finish_reason=wire.FinishReason.ERROR,
                                             error=message))

    def end(self, generation: Generation, finish: wire.FinishInfo) -> None:
        """Ends a generation here (its engine can no longer say how it ended)."""
        self._unregister(generation)
        generation.finished = True
        generation.queue.put_nowait(TextDelta(generation.index, "", 0, finish))

    def _forget(self, generation: Generation) -> None:
        if self._unregister(generation):
            generation.finished = True

    def _unregister(self, generation: Generation) -> bool:
        if self._generations.pop(generation.request_id, None) is None:
            return False
        self._view.track(generation.engine_id, -1)
        return True

    # ---- outputs from tokenizers

    async def _on_outputs(self, batch: wire_pb.TextOutputBatch) -> None:
        """One step's text for this gateway's requests. Parsed in upb (betterproto took ~0.2 ms
        a step at 32 rows); a finish record or logprobs, rare, become betterproto's here, the
        type the rest of the gateway reads."""
        request_ids = unpack_strings(batch.request_ids)
        texts = unpack_strings(batch.texts)
        counts = unpack_int32(batch.num_new_tokens).tolist()
        reasons = unpack_uint8(batch.finish_reasons).tolist()
        token_ids = unpack_int32(batch.token_ids).tolist()
        positions = unpack_int32(batch.output_positions).tolist()
        offsets = [0] * len(counts)
        for i in range(1, len(counts)):
            offsets[i] = offsets[i - 1] + counts[i - 1]
        finished = {info.request_id: wire.FinishInfo().parse(info.SerializeToString())
                    for info in batch.finished}
        logprobs: dict[str, list[wire.TokenLogprobs]] = defaultdict(list)
        for entry in batch.logprobs:
            logprobs[entry.request_id].append(wire.TokenLogprobs().parse(
                entry.SerializeToString()))
        for i, request_id in enumerate(request_ids):
            generation = self._generations.get(request_id)
            if generation is None:
                continue  # aborted here already
            if positions and positions[i] != len(generation.output_token_ids):
                # Output lost in flight (a NATS restart): continue from what the client has.
                self.migrator.move([generation], "output was lost in flight")
                continue
            finish = finished.get(request_id) if reasons[i] else None
            if finish is not None and finish.movable and is_movable(generation):
                self.migrator.move([generation], finish.error.split(";")[0])
                continue
            new_token_ids = token_ids[offsets[i]:offsets[i] + counts[i]]
            generation.output_token_ids += new_token_ids
            generation.num_chars += len(texts[i])
            generation.last_output_at = time.monotonic()
            generation.queue.put_nowait(TextDelta(generation.index, texts[i], counts[i], finish,
                                                  logprobs.get(request_id, []), new_token_ids))
            if finish is not None:
                self._forget(generation)
