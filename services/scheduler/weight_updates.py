"""Weight updates on the scheduler's side: the engine's admin commands load_weights,
commit_weights, discard_weights and weight_version (POST /update_weights_from_disk and
GET /get_weight_version at the gateway, which runs the two phases over every engine).

- load_weights: the worker builds the new weights beside the serving ones; requests go on.
- commit_weights (vLLM's pause / update / resume): queued requests that have not started are
  held (they keep their place; nothing is refused), the requests under way finish on the old
  weights, the worker swaps them in between two steps, the prefix cache is emptied (its KV
  was computed with the old weights) and the KV connector takes the worker's new
  fingerprint (the kvstore's blocks of the old weights are never loaded again). Then the
  held requests start, on the new weights: no request mixes versions.
- A worker that restarts comes back with the checkpoint it started from: the last committed
  update is applied to it again before it takes a step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.common import wire
from services.common.bus import Bus, BusError
from services.common.subjects import Subjects

WEIGHT_COMMANDS = ("load_weights", "commit_weights", "discard_weights", "weight_version")
# Reading a big checkpoint takes a while; a commit waits for the requests under way.
_WORKER_LOAD_TIMEOUT_S = 600.0
_WORKER_SWAP_TIMEOUT_S = 60.0
_POLL_S = 0.02


@dataclass(frozen=True)
class _Update:
    model_path: str
    version: str


class EnginePause:
    """What a commit needs of the scheduler service, between its steps."""

    def __init__(self, hold: Callable[[bool], None], num_started: Callable[[], int],
                 is_idle: Callable[[], bool], forget_kv: Callable[[], bool],
                 on_new_fingerprint: Callable[[str], None]):
        self.hold = hold                     # hold (True) or release (False) new requests
        self.num_started = num_started       # requests under way
        self.is_idle = is_idle               # no request under way, no KV transfer
        self.forget_kv = forget_kv           # empties the prefix cache; False: blocks in use
        self.on_new_fingerprint = on_new_fingerprint


class WeightUpdateControl:
    def __init__(self, bus: Bus, subjects: Subjects, engine_id: str,
                 log: structlog.stdlib.BoundLogger) -> None:
        self._bus = bus
        self._subject = subjects.worker_weights(engine_id)
        self._log = log
        self.version = ""                    # what the worker serves (its WorkerInfo)
        self._loaded: _Update | None = None  # staged on the worker, not committed
        self._committed: _Update | None = None
        self._lock = asyncio.Lock()          # one weight command at a time

    async def on_admin(self, message: wire.AdminRequest, pause: EnginePause) -> wire.AdminReply:
        if message.command == "weight_version":
            return self._reply()
        async with self._lock:
            if message.command == "load_weights":
                return await self._load(_Update(message.model_path, message.weight_version))
            if message.command == "commit_weights":
                return await self._commit(pause)
            self._loaded = None
            return self._reply_of(await self._call_worker("discard"))

    async def on_worker_joined(self, info: wire.WorkerInfo, pause: EnginePause) -> None:
        """A (re)started worker serves the weights it started with: the last committed
        update goes to it again before it takes a step."""
        self.version = info.weight_version
        update = self._committed
        if update is None or info.weight_version == update.version:
            return
        self._log.info("the worker restarted with its first weights; applying the last "
                       "update again", weight_version=update.version)
        async with self._lock:
            loaded = await self._call_worker("load", update)
            reply = loaded if loaded.error else await self._call_worker("commit")
        if reply.error:
            self._log.error("the worker restarted and did not take the last weight update; it "
                            "serves its first weights", error=reply.error,
                            weight_version=self.version)
            return
        pause.on_new_fingerprint(reply.kv_fingerprint)

    async def _load(self, update: _Update) -> wire.AdminReply:
        if not update.model_path or not update.version:
            return self._reply("load_weights needs a model_path and a weight_version", 400)
        reply = await self._call_worker("load", update)
        self._loaded = None if reply.error else update
        return self._reply_of(reply)

    async def _commit(self, pause: EnginePause) -> wire.AdminReply:
        if self._loaded is None:
            return self._reply("no weights are loaded to commit (load_weights first)", 400)
        started = time.perf_counter()
        pause.hold(True)
        num_under_way = pause.num_started()
        try:
            await _until(pause.is_idle)
            reply = await self._call_worker("commit")
            if not reply.error:
                self._committed, self._loaded = self._loaded, None
                await _until(pause.forget_kv)   # idle: only a step's last frees remain
                pause.on_new_fingerprint(reply.kv_fingerprint)
        finally:
            pause.hold(False)
        reply.seconds = time.perf_counter() - started
        self._log.info("weight update committed" if not reply.error else "weight commit failed",
                       weight_version=self.version, seconds=round(reply.seconds, 3),
                       requests_finished_first=num_under_way, error=reply.error or None)
        admin = self._reply_of(reply)
        admin.num_requests_finished_first = num_under_way
        return admin

    async def _call_worker(self, command: str, update: _Update | None = None
                           ) -> wire.WeightUpdateReply:
        message = wire.WeightUpdateRequest(command=command)
        if update is not None:
            message.model_path, message.weight_version = update.model_path, update.version
        timeout = _WORKER_LOAD_TIMEOUT_S if command == "load" else _WORKER_SWAP_TIMEOUT_S
        try:
            reply = await self._bus.request(self._subject, message, wire.WeightUpdateReply,
                                            timeout=timeout)
        except BusError as exc:
            return wire.WeightUpdateReply(error=f"the worker did not answer: {exc}",
                                          http_status=503, weight_version=self.version)
        self.version = reply.weight_version or self.version
        return reply

    def _reply_of(self, reply: wire.WeightUpdateReply) -> wire.AdminReply:
        admin = self._reply(reply.error, reply.http_status or 503)
        admin.seconds = reply.seconds
        return admin

    def _reply(self, error: str = "", http_status: int = 0) -> wire.AdminReply:
        return wire.AdminReply(ok=not error, error=error,
                               http_status=http_status if error else 0,
                               weight_version=self.version)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(_POLL_S)
