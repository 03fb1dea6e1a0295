"""Sleep mode on the scheduler's side (services/scheduler/sleep_control.py), over a real NATS
server with a stand-in worker on the worker's subjects: a sleep refuses new requests from
the moment it is asked, waits for the requests in flight, and forgets the KV only once the
worker has released it; bad arguments never reach the worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import structlog

from llm_mesh.embedded import EmbeddedNats
from services.common import wire
from services.common.bus import Bus
from services.common.subjects import Subjects
from services.scheduler.sleep_control import SleepControl
from tests.waiting import until

SUBJECTS = Subjects("sleep-test")
ENGINE = "engine-0"


class StandInWorker:
    """Answers sleep and wake-up as a worker with --enable-sleep-mode does."""

    def __init__(self) -> None:
        self.sleeping: set[str] = set()
        self.calls: list[str] = []

    async def sleep(self, message: wire.SleepRequest) -> wire.SleepReply:
        self.calls.append(f"sleep {message.level}")
        self.sleeping = {"weights", "kv_cache"}
        return wire.SleepReply(sleeping_tags=sorted(self.sleeping))

    async def wake_up(self, message: wire.WakeUpRequest) -> wire.SleepReply:
        self.calls.append(f"wake_up {','.join(message.tags)}")
        self.sleeping -= set(message.tags or ["weights", "kv_cache"])
        return wire.SleepReply(sleeping_tags=sorted(self.sleeping))


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    with EmbeddedNats() as server:
        connected = await Bus.connect(server.url, "sleep-test", retry_for_s=10.0)
        try:
            yield connected
        finally:
            await connected.close()


async def serve_worker(bus: Bus) -> StandInWorker:
    worker = StandInWorker()
    await bus.serve(SUBJECTS.worker_sleep(ENGINE), wire.SleepRequest, worker.sleep)
    await bus.serve(SUBJECTS.worker_wake_up(ENGINE), wire.WakeUpRequest, worker.wake_up)
    return worker


def admin(command: str, level: int = 0, tags: tuple[str, ...] = ()) -> wire.AdminRequest:
    return wire.AdminRequest(command=command, level=level, tags=list(tags))


async def test_sleep_refuses_requests_at_once_and_releases_after_the_requests_in_flight(
        bus: Bus) -> None:
    worker = await serve_worker(bus)
    control = SleepControl(bus, SUBJECTS, ENGINE, structlog.get_logger())
    requests_done = asyncio.Event()
    forgotten: list[bool] = []

    async def wait_idle() -> None:
        await requests_done.wait()

    def forget_kv() -> bool:
        forgotten.append(control.is_sleeping)
        return True

    sleeping = asyncio.create_task(control.on_admin(admin("sleep", 1), wait_idle, forget_kv))
    await until(lambda: control.refuses_requests, what="the sleep to start")
    assert not control.is_sleeping   # it waits for the requests in flight
    assert control.refusal().error_code == "engine_sleeping"
    assert control.refusal().retry_after_s > 0
    assert worker.calls == [] and forgotten == []

    requests_done.set()
    reply = await sleeping
    assert reply.ok and reply.is_sleeping
    assert worker.calls == ["sleep 1"] and forgotten == [True]

    reply = await control.on_admin(admin("wake_up", tags=("weights",)), wait_idle, forget_kv)
    assert reply.ok and reply.is_sleeping and control.refuses_requests   # the KV still sleeps
    reply = await control.on_admin(admin("wake_up"), wait_idle, forget_kv)
    assert reply.ok and not reply.is_sleeping and not control.refuses_requests
    assert (await control.on_admin(admin("is_sleeping"), wait_idle, forget_kv)).ok


async def test_bad_arguments_and_a_worker_without_sleep_mode_answer_400(bus: Bus) -> None:
    control = SleepControl(bus, SUBJECTS, ENGINE, structlog.get_logger())

    async def idle() -> None:
        return None

    for message in (admin("sleep", 3), admin("wake_up", tags=("optimizer",)),
                    admin("sleep", 1)):   # the last: no worker serves sleep mode
        reply = await control.on_admin(message, idle, lambda: None)
        assert not reply.ok and reply.http_status == 400, message
        assert not control.refuses_requests
    assert "--enable-sleep-mode" in reply.error
