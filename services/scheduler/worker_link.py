"""The scheduler's view of its worker: discovery, liveness and step calls.

The worker announces itself (WorkerInfo on the hello subject) when it starts; a scheduler
that starts later asks for it. Each worker start has a new incarnation number: a new
incarnation holds no request rows, so what ran on the old one is lost. The worker's
heartbeats prove it alive while a long step runs, so a dead worker is noticed within
seconds rather than at the step timeout.

Steps go over the worker's local step channel when it runs on this host
(services/common/step_channel.py: a socket, so a worker that dies is noticed at once), else
over NATS request/reply. Either way they are the same upb-encoded bytes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import cast

import structlog

from services.common import wire, wire_pb
from services.common.bus import Bus, BusError
from services.common.packing import unpack_int32
from services.common.step_channel import ChannelClosed, StepChannelClient, host_identity
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks
from services.common.timing import STEP_WATCH_INTERVAL_S


class WorkerGone(Exception):
    """The worker died, restarted or failed a step: its per-request state is lost."""


class StepFailed(WorkerGone):
    """The worker answered a step with an error: running it again would fail again."""


@dataclass(slots=True)
class StepReply:
    output: wire_pb.StepOutput
    sent_at: float       # time.perf_counter() when the step went out, before its encoding
    received_at: float   # ... when its answer arrived, before the event loop took it up

    def hops(self, worker_free_at: float, taken_at: float) -> StepHops | None:
        """Where the step's messaging went, from the worker's clock marks (local channel
        only: one host, one clock). `worker_free_at`: when the worker answered the step
        before (a step sent while that one ran waits for it, and that wait is not a hop);
        `taken_at`: when the event loop took the answer up."""
        out = self.output
        if not out.worker_received_at:
            return None
        return StepHops(
            to_worker=out.worker_received_at - max(self.sent_at, worker_free_at),
            worker=max(0.0, out.worker_sent_at - out.worker_received_at - out.execute_s),
            back=self.received_at - out.worker_sent_at,
            to_loop=taken_at - self.received_at)


@dataclass(slots=True)
class StepHops:
    """A step's messaging, hop by hop (seconds)."""
    to_worker: float   # encode, write, the worker's read (it waits on its socket)
    worker: float      # the worker's decode and encode around its execute
    back: float        # the answer's write and the scheduler's read
    to_loop: float     # the arrival until the scheduler's event loop takes it up


# What a step's answer arrives as: the channel's bytes or NATS's message, and when.
_Arrival = tuple[bytes | wire_pb.StepOutput, float]


@dataclass(eq=False, slots=True)
class _StepCall:
    """A step sent and not answered yet, with what its fate depends on."""
    reply: asyncio.Future[_Arrival]
    incarnation: int
    sent_at: float
    reconnects: tuple[int, int] | None = None   # NATS steps: (ours, the worker's) when sent
    request: asyncio.Task[wire_pb.StepOutput] | None = None   # NATS steps: the request

    def give_up(self, reason: BaseException | None = None) -> None:
        """Nobody takes its reply: fails it with `reason` (else cancels it)."""
        if not self.reply.done():
            if reason is None:
                self.reply.cancel()
            else:
                self.reply.set_exception(reason)
        if self.request is not None:
            self.request.cancel()


def _settle(reply: asyncio.Future[_Arrival], request: asyncio.Task[wire_pb.StepOutput]) -> None:
    if reply.done():
        return
    if request.cancelled():
        reply.cancel()
    elif (exc := request.exception()) is not None:
        reply.set_exception(exc)
    else:
        reply.set_result((request.result(), time.perf_counter()))


class WorkerLink:
    def __init__(self, bus: Bus, subjects: Subjects, engine_id: str,
                 log: structlog.stdlib.BoundLogger, step_timeout_s: float,
                 heartbeat_timeout_s: float, step_transport: str = "auto") -> None:
        self._bus = bus
        self._subjects = subjects
        self._engine_id = engine_id
        self._log = log
        self._step_timeout_s = step_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self._use_local_channel = step_transport == "auto"
        self.info: wire.WorkerInfo | None = None
        self.eos_token_ids: list[int] = []
        self.changed = asyncio.Event()   # set when a (new) worker incarnation appears
        self._last_heartbeat = 0.0
        self._worker_reconnects = 0      # the worker's NATS reconnects, from its heartbeats
        self._channel: StepChannelClient | None = None
        self._calls: set[_StepCall] = set()

    async def start(self, tasks: BackgroundTasks) -> None:
        await self._bus.subscribe(self._subjects.worker_hello(self._engine_id), wire.WorkerInfo,
                                  self._on_hello)
        await self._bus.subscribe(self._subjects.heartbeat, wire.Heartbeat, self._on_heartbeat)
        tasks.spawn(self._ask_for_info(), name="ask the worker for its info")
        tasks.spawn(self._watch_calls(), name="watch steps in flight")

    @property
    def is_alive(self) -> bool:
        return time.monotonic() - self._last_heartbeat < self._heartbeat_timeout_s

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.is_alive

    @property
    def transport(self) -> str:
        """Where steps go now: "local" (the step channel) or "nats"."""
        return "local" if self._channel is not None and self._channel.is_open else "nats"

    async def wait_ready(self) -> wire.WorkerInfo:
        while not self.is_ready:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        assert self.info is not None
        return self.info

    async def execute(self, step: wire_pb.StepInput, incarnation: int) -> StepReply:
        """Runs one step on the worker incarnation the caller's state belongs to."""
        self._check(incarnation)
        call = self._send(step, incarnation)
        self._calls.add(call)
        try:
            payload, received_at = await call.reply
        except ChannelClosed as exc:
            self._last_heartbeat = 0.0   # its process is gone: wait for its next start
            raise WorkerGone(str(exc)) from exc
        except BusError as exc:
            raise WorkerGone(str(exc)) from exc
        finally:
            self._calls.discard(call)
            call.give_up()   # a no-op once it is answered
        output = (wire_pb.StepOutput.FromString(payload) if isinstance(payload, bytes)
                  else payload)
        if output.error:
            raise StepFailed(f"step failed on the worker: {output.error}")
        return StepReply(output, call.sent_at, received_at)

    def _send(self, step: wire_pb.StepInput, incarnation: int) -> _StepCall:
        if self.transport == "local":
            assert self._channel is not None
            sent_at = time.perf_counter()
            frame = step.SerializeToString()
            return _StepCall(cast(asyncio.Future[_Arrival], self._channel.send(frame)),
                             incarnation, sent_at)
        reply: asyncio.Future[_Arrival] = asyncio.get_running_loop().create_future()
        sent_at = time.perf_counter()
        request = asyncio.create_task(self._bus.request(
            self._subjects.worker_step(self._engine_id), step, wire_pb.StepOutput,
            timeout=self._step_timeout_s))
        request.add_done_callback(lambda done: _settle(reply, done))
        return _StepCall(reply, incarnation, sent_at,
                         (self._bus.reconnects, self._worker_reconnects), request)

    async def _watch_calls(self) -> None:
        """Fails the steps in flight whose worker is gone, changed or lost touch: without a
        reply they would wait for the step timeout."""
        while True:
            await asyncio.sleep(STEP_WATCH_INTERVAL_S)
            for call in list(self._calls):
                if (reason := self._lost_reason(call)) is not None:
                    call.give_up(WorkerGone(reason))

    def _lost_reason(self, call: _StepCall) -> str | None:
        if not self.is_alive:
            return "no heartbeat from the worker"
        if self.info is None or self.info.incarnation != call.incarnation:
            return "the worker restarted"
        if (call.reconnects is not None
                and (self._bus.reconnects, self._worker_reconnects) != call.reconnects):
            # The step or its reply may be lost: its fate is unknown.
            return "a NATS reconnect interrupted the step"
        return None

    def _check(self, incarnation: int) -> None:
        if self.info is None or self.info.incarnation != incarnation:
            raise WorkerGone("the worker restarted")

    async def _ask_for_info(self) -> None:
        """A scheduler that starts after its worker asks for the worker's info."""
        while self.info is None:
            try:
                info = await self._bus.request(self._subjects.worker_info(self._engine_id),
                                               wire.WorkerInfoRequest(), wire.WorkerInfo,
                                               timeout=2.0)
                await self._on_hello(info)
            except BusError:
                await asyncio.sleep(0.5)

    async def _on_hello(self, info: wire.WorkerInfo) -> None:
        if self.info is not None and info.incarnation == self.info.incarnation:
            return
        await self._open_channel(info)
        self._log.info("worker joined", worker_id=info.worker_id, num_blocks=info.num_blocks,
                       block_size=info.block_size, max_model_len=info.max_model_len,
                       step_transport=self.transport, restarted=self.info is not None)
        self.info = info
        self.eos_token_ids = unpack_int32(info.eos_token_ids).tolist()
        self._last_heartbeat = time.monotonic()
        self.changed.set()

    async def _open_channel(self, info: wire.WorkerInfo) -> None:
        """Connects to the new incarnation's local step channel where it can be reached."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        if not (self._use_local_channel and info.step_channel
                and info.host_id and info.host_id == host_identity()):
            return
        try:
            self._channel = await StepChannelClient.connect(info.step_channel)
        except OSError as exc:
            self._log.warning("the worker's local step channel cannot be opened; stepping "
                              "it over NATS", error=str(exc))

    async def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if beat.service == "worker" and beat.engine_id == self._engine_id and beat.ready:
            self._last_heartbeat = time.monotonic()
            self._worker_reconnects = beat.reconnects
