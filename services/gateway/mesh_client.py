"""The gateway's side of the request path: encode with a tokenizer, submit to an engine,
receive text outputs, abort, and fail requests whose tokenizer or engine is gone."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field

from services.common import wire
from services.common.bus import Bus, BusError, NoResponders
from services.common.packing import unpack_int32, unpack_strings, unpack_uint8
from services.common.subjects import Subjects
from services.gateway.errors import ApiError, unavailable
from services.gateway.mesh_view import EngineView, Instance, MeshView


@dataclass
class TextDelta:
    """One step's output for one request (one choice)."""
    index: int                                   # choice index within its HTTP request
    text: str
    num_new_tokens: int
    finish: wire.FinishInfo | None = None
    logprobs: list[wire.TokenLogprobs] = field(default_factory=list)


@dataclass
class Generation:
    """A request (one choice) running in the mesh, as this gateway tracks it."""
    request_id: str
    index: int
    engine_id: str
    scheduler_id: str                           # the scheduler instance holding its state
    tokenizer_id: str
    queue: asyncio.Queue[TextDelta]             # shared by the choices of one HTTP request
    finished: bool = False


class MeshClient:
    def __init__(self, bus: Bus, subjects: Subjects, gateway_id: str, view: MeshView,
                 tokenizer_timeout_s: float) -> None:
        self._bus = bus
        self._subjects = subjects
        self.gateway_id = gateway_id
        self._view = view
        self._tokenizer_timeout_s = tokenizer_timeout_s
        self._generations: dict[str, Generation] = {}

    async def start(self) -> None:
        await self._bus.subscribe(self._subjects.gateway_outputs(self.gateway_id),
                                  wire.TextOutputBatch, self._on_outputs)

    # ---- tokenizer calls

    async def encode(self, request: wire.EncodeRequest) -> wire.EncodeReply:
        reply = await self._call_tokenizer(self._subjects.tokenizer_encode, request,
                                           wire.EncodeReply)
        if reply.error:
            raise ApiError(400, reply.error)
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
                     queue: asyncio.Queue[TextDelta]) -> Generation:
        # Registered before sending: outputs may arrive before the submit reply does.
        engine_id = engine.engine_id
        generation = Generation(request.request_id, index, engine_id, engine.scheduler_id,
                                request.tokenizer_id, queue)
        self._generations[request.request_id] = generation
        self._view.track(engine_id, +1)
        try:
            reply = await self._bus.request(self._subjects.engine_submit(engine_id), request,
                                            wire.SubmitReply, timeout=self._tokenizer_timeout_s)
        except BusError as exc:
            self._forget(generation)
            raise unavailable(f"engine {engine_id} did not accept the request: {exc}",
                              code="engine_unavailable") from exc
        if not reply.accepted:
            self._forget(generation)
            raise ApiError(reply.http_status or 503, reply.error, code=reply.error_code or None,
                           retry_after_s=reply.retry_after_s or None)
        return generation

    async def admin(self, engine_id: str, command: str) -> wire.AdminReply:
        return await self._bus.request(self._subjects.engine_admin(engine_id),
                                       wire.AdminRequest(command=command), wire.AdminReply,
                                       timeout=self._tokenizer_timeout_s)

    async def abort(self, generations: list[Generation]) -> None:
        """Stops unfinished generations in their engines and drops their tokenizer state."""
        by_engine: dict[str, list[str]] = defaultdict(list)
        by_tokenizer: dict[str, list[str]] = defaultdict(list)
        for generation in generations:
            if generation.finished:
                continue
            self._forget(generation)
            by_engine[generation.engine_id].append(generation.request_id)
            by_tokenizer[generation.tokenizer_id].append(generation.request_id)
        for engine_id, ids in by_engine.items():
            await self._bus.publish(self._subjects.engine_abort(engine_id),
                                    wire.AbortRequest(request_ids=ids,
                                                      reason=wire.FinishReason.ABORT))
        for tokenizer_id, ids in by_tokenizer.items():
            await self.release(tokenizer_id, ids)

    def fail_instance(self, instance: Instance) -> int:
        """Ends every generation whose state lived in a tokenizer or scheduler that is gone.
        (A lost worker is its scheduler's business: it fails or keeps its requests.)"""
        lost = [g for g in self._generations.values()
                if instance.instance_id in (g.tokenizer_id, g.scheduler_id)]
        for generation in lost:
            self._finish_with_error(generation, f"the {instance.service} serving this request "
                                                f"stopped; retry the request")
        return len(lost)

    def _finish_with_error(self, generation: Generation, message: str) -> None:
        self._forget(generation)
        generation.queue.put_nowait(TextDelta(
            generation.index, "", 0,
            wire.FinishInfo(request_id=generation.request_id,
                            finish_reason=wire.FinishReason.ERROR, error=message)))

    def _forget(self, generation: Generation) -> None:
        if self._generations.pop(generation.request_id, None) is not None:
            generation.finished = True
            self._view.track(generation.engine_id, -1)

    # ---- outputs from tokenizers

    async def _on_outputs(self, batch: wire.TextOutputBatch) -> None:
        request_ids = unpack_strings(batch.request_ids)
        texts = unpack_strings(batch.texts)
        counts = unpack_int32(batch.num_new_tokens).tolist()
        reasons = unpack_uint8(batch.finish_reasons).tolist()
        finished = {info.request_id: info for info in batch.finished}
        logprobs: dict[str, list[wire.TokenLogprobs]] = defaultdict(list)
        for entry in batch.logprobs:
            logprobs[entry.request_id].append(entry)
        for i, request_id in enumerate(request_ids):
            generation = self._generations.get(request_id)
            if generation is None:
                continue  # aborted here already
            finish = finished.get(request_id) if reasons[i] else None
            generation.queue.put_nowait(TextDelta(generation.index, texts[i], counts[i], finish,
                                                  logprobs.get(request_id, [])))
            if finish is not None:
                self._forget(generation)
