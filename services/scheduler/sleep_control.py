"""Sleep mode on the scheduler's side: the engine's admin commands sleep, wake_up and
is_sleeping (POST /sleep, POST /wake_up, GET /is_sleeping at the gateway).

Sleep stops admitting requests (503 + Retry-After, error code engine_sleeping), lets the
requests in flight finish (vLLM's sleep wants none in flight), then has the worker release
its weights and KV cache (services/worker/runner/sleep_mode.py). The KV is gone, so the
scheduler's prefix cache is emptied and the worker's request rows start afresh. Wake-up
restores what its tags name; requests are admitted again once nothing sleeps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from services.common import wire
from services.common.bus import Bus, BusError, NoResponders
from services.common.subjects import Subjects

SLEEP_COMMANDS = ("sleep", "wake_up", "is_sleeping")
SLEEP_TAGS = ("weights", "kv_cache")
RETRY_AFTER_S = 5.0     # what a request refused while the engine sleeps is told
# Loading a model back (level 2: from the checkpoint's files) takes a while on a big model.
_WORKER_TIMEOUT_S = 300.0


class SleepControl:
    def __init__(self, bus: Bus, subjects: Subjects, engine_id: str,
                 log: structlog.stdlib.BoundLogger) -> None:
        self._bus = bus
        self._subjects = subjects
        self._engine_id = engine_id
        self._log = log
        self.sleeping_tags: list[str] = []   # what the worker has released
        self._is_pausing = False             # a sleep waits for the requests in flight
        self._lock = asyncio.Lock()          # one sleep or wake-up at a time

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @property
    def refuses_requests(self) -> bool:
        return self._is_pausing or self.is_sleeping

    def refusal(self) -> wire.SubmitReply:
        return wire.SubmitReply(
            http_status=503, error_code="engine_sleeping", retry_after_s=RETRY_AFTER_S,
            error=f"engine {self._engine_id} is sleeping (POST /sleep): requests are refused "
                  f"until POST /wake_up; retry after {RETRY_AFTER_S:.0f} s")

    def on_worker_joined(self) -> None:
        """A (re)started worker holds its weights and KV cache: nothing sleeps."""
        if self.sleeping_tags:
            self._log.info("the worker restarted awake")
        self.sleeping_tags = []

    async def on_admin(self, message: wire.AdminRequest, wait_idle: Callable[[], Awaitable[None]],
                       forget_kv: Callable[[], bool]) -> wire.AdminReply:
        """`wait_idle` returns once no request is in flight; `forget_kv` empties the prefix
        cache and has the worker's rows start afresh."""
        if message.command == "is_sleeping":
            return self._reply()
        async with self._lock:
            if message.command == "sleep":
                return await self._sleep(message.level, wait_idle, forget_kv)
            return await self._wake_up(list(message.tags))

    async def _sleep(self, level: int, wait_idle: Callable[[], Awaitable[None]],
                     forget_kv: Callable[[], bool]) -> wire.AdminReply:
        if level not in (1, 2):
            return self._reply(f"sleep level must be 1 or 2, not {level}", 400)
        self._is_pausing = True
        try:
            await wait_idle()
            reply = await self._call_worker(self._subjects.worker_sleep(self._engine_id),
                                            wire.SleepRequest(level=level))
            if self.is_sleeping:
                if not forget_kv():   # never expected: the sleep waited for every request
                    self._log.error("prefix cache not reset after sleep: blocks are in use")
            return reply
        finally:
            self._is_pausing = False

    async def _wake_up(self, tags: list[str]) -> wire.AdminReply:
        if unknown := set(tags) - set(SLEEP_TAGS):
            return self._reply(f"unknown wake_up tags {sorted(unknown)} (choose from "
                               f"{', '.join(SLEEP_TAGS)})", 400)
        return await self._call_worker(self._subjects.worker_wake_up(self._engine_id),
                                       wire.WakeUpRequest(tags=tags))

    async def _call_worker(self, subject: str, message: wire.SleepRequest | wire.WakeUpRequest
                           ) -> wire.AdminReply:
        try:
            reply = await self._bus.request(subject, message, wire.SleepReply,
                                            timeout=_WORKER_TIMEOUT_S)
        except NoResponders:
            return self._reply(f"sleep mode is off on engine {self._engine_id}: start its "
                               "worker with --enable-sleep-mode", 400)
        except BusError as exc:
            return self._reply(f"the worker did not answer: {exc}", 503)
        self.sleeping_tags = list(reply.sleeping_tags)
        self._log.info("sleep mode", command=type(message).__name__, seconds=reply.seconds,
                       sleeping=self.sleeping_tags, error=reply.error or None)
        return self._reply(reply.error, 503) if reply.error else self._reply()

    def _reply(self, error: str = "", http_status: int = 0) -> wire.AdminReply:
        return wire.AdminReply(ok=not error, error=error, http_status=http_status,
                               is_sleeping=self.is_sleeping)
