"""The scheduler's view of its worker: discovery, liveness and step calls.

The worker announces itself (WorkerInfo on the hello subject) when it starts; a scheduler
that starts later asks for it. Each worker start has a new incarnation number: a new
incarnation holds no request rows, so what ran on the old one is lost. The worker's
heartbeats prove it alive while a long step runs, so a dead worker is noticed within
seconds rather than at the step timeout.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common import wire
from services.common.bus import Bus, BusError
from services.common.packing import unpack_int32
from services.common.subjects import Subjects
from services.common.tasks import BackgroundTasks


class WorkerGone(Exception):
    """The worker died, restarted or failed a step: its per-request state is lost."""


class StepFailed(WorkerGone):
    """The worker answered a step with an error: running it again would fail again."""


class WorkerLink:
    def __init__(self, bus: Bus, subjects: Subjects, engine_id: str,
                 log: structlog.stdlib.BoundLogger, step_timeout_s: float,
                 heartbeat_timeout_s: float) -> None:
        self._bus = bus
        self._subjects = subjects
        self._engine_id = engine_id
        self._log = log
        self._step_timeout_s = step_timeout_s
        self._heartbeat_timeout_s = heartbeat_timeout_s
        self.info: wire.WorkerInfo | None = None
        self.eos_token_ids: list[int] = []
        self.changed = asyncio.Event()   # set when a (new) worker incarnation appears
        self._last_heartbeat = 0.0
        self._worker_reconnects = 0      # the worker's NATS reconnects, from its heartbeats

    async def start(self, tasks: BackgroundTasks) -> None:
        await self._bus.subscribe(self._subjects.worker_hello(self._engine_id), wire.WorkerInfo,
                                  self._on_hello)
        await self._bus.subscribe(self._subjects.heartbeat, wire.Heartbeat, self._on_heartbeat)
        tasks.spawn(self._ask_for_info(), name="ask the worker for its info")

    @property
    def is_alive(self) -> bool:
        return time.monotonic() - self._last_heartbeat < self._heartbeat_timeout_s

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.is_alive

    async def wait_ready(self) -> wire.WorkerInfo:
        while not self.is_ready:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass
        assert self.info is not None
        return self.info

    async def execute(self, step: wire.StepInput, incarnation: int) -> wire.StepOutput:
        """Runs one step on the worker incarnation the caller's state belongs to."""
        self._check(incarnation)
        reconnects = (self._bus.reconnects, self._worker_reconnects)
        call = asyncio.create_task(self._bus.request(
            self._subjects.worker_step(self._engine_id), step, wire.StepOutput,
            timeout=self._step_timeout_s))
        try:
            while not call.done():
                await asyncio.wait({call}, timeout=0.5)
                if call.done():
                    break
                if not self.is_alive:
                    raise WorkerGone("no heartbeat from the worker")
                if (self._bus.reconnects, self._worker_reconnects) != reconnects:
                    # The step or its reply may be lost: its fate is unknown.
                    raise WorkerGone("a NATS reconnect interrupted the step")
                self._check(incarnation)
        finally:
            call.cancel()   # a no-op once it is done; else nobody waits for its reply
        try:
            output = call.result()
        except BusError as exc:
            raise WorkerGone(str(exc)) from exc
        if output.error:
            raise StepFailed(f"step failed on the worker: {output.error}")
        return output

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
        self._log.info("worker joined", worker_id=info.worker_id, num_blocks=info.num_blocks,
                       block_size=info.block_size, max_model_len=info.max_model_len,
                       restarted=self.info is not None)
        self.info = info
        self.eos_token_ids = unpack_int32(info.eos_token_ids).tolist()
        self._last_heartbeat = time.monotonic()
        self.changed.set()

    async def _on_heartbeat(self, beat: wire.Heartbeat) -> None:
        if beat.service == "worker" and beat.engine_id == self._engine_id and beat.ready:
            self._last_heartbeat = time.monotonic()
            self._worker_reconnects = beat.reconnects
