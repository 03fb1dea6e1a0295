"""The local step channel: frames answered in order, a dead side noticed at once, a new
scheduler taking over, and nothing left behind when a worker is SIGKILLed. The scheduler's
end runs on asyncio's loop and on uvloop's (what the services run)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import uvloop

from services.common.step_channel import (
    ChannelClosed,
    StepChannelClient,
    StepChannelServer,
    host_identity,
)

Run = Callable[[Coroutine[Any, Any, None]], None]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    return asyncio.run if request.param == "asyncio" else uvloop.run


def unique_name() -> str:
    return f"llm-mesh-test/{uuid.uuid4().hex}"


@contextmanager
def serving(handle: Callable[[bytes], bytes]) -> Iterator[StepChannelServer]:
    server = StepChannelServer(unique_name())
    thread = threading.Thread(target=server.serve, args=(handle,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_frames_are_answered_in_order_even_when_sent_ahead(run: Run) -> None:
    async def scenario() -> None:
        with serving(lambda frame: frame[::-1]) as server:
            client = await StepChannelClient.connect(server.name)
            # Empty, small and multi-megabyte frames, all sent before the first answer.
            frames = [b"", b"step-1", bytes(range(256)) * 16384, b"x" * 3]
            answers = await asyncio.gather(*(client.send(f) for f in frames))
            assert [a.frame for a in answers] == [f[::-1] for f in frames]
            assert [a.received_at for a in answers] == sorted(a.received_at for a in answers)
            client.close()

    run(scenario())


def test_a_stopping_server_answers_the_step_it_runs_then_closes(run: Run) -> None:
    running, release = threading.Event(), threading.Event()

    def slow(frame: bytes) -> bytes:
        running.set()
        release.wait(5)
        return frame

    async def scenario() -> None:
        with serving(slow) as server:
            client = await StepChannelClient.connect(server.name)
            pending = client.send(b"in flight")
            assert await asyncio.to_thread(running.wait, 5)
            server.stop()
            release.set()
            assert (await asyncio.wait_for(pending, 5)).frame == b"in flight"
            with pytest.raises(ChannelClosed):
                await asyncio.wait_for(client.send(b"after the end"), 5)
            assert not client.is_open

    run(scenario())


def test_a_new_client_replaces_the_one_before(run: Run) -> None:
    async def scenario() -> None:
        with serving(lambda frame: frame + b"!") as server:
            first = await StepChannelClient.connect(server.name)
            assert (await first.send(b"a")).frame == b"a!"
            second = await StepChannelClient.connect(server.name)
            assert (await asyncio.wait_for(second.send(b"b"), 5)).frame == b"b!"
            with pytest.raises(ChannelClosed):
                await asyncio.wait_for(first.send(b"c"), 5)
            second.close()

    run(scenario())


def test_nobody_listening_is_an_oserror(run: Run) -> None:
    async def scenario() -> None:
        with pytest.raises(OSError):
            await StepChannelClient.connect(unique_name())

    run(scenario())


def _serve_until_killed(name: str, ready: Any) -> None:
    server = StepChannelServer(name)
    ready.set()
    server.serve(lambda frame: frame)


def test_a_sigkilled_worker_leaves_no_name_and_no_shm_behind(run: Run) -> None:
    shm_before = set(os.listdir("/dev/shm"))
    name = unique_name()
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    worker = context.Process(target=_serve_until_killed, args=(name, ready), daemon=True)
    worker.start()
    assert ready.wait(10)

    async def scenario() -> None:
        client = await StepChannelClient.connect(name)
        assert (await client.send(b"ping")).frame == b"ping"
        pending = client.send(b"lost")   # answered or not, depending on when the kill lands
        os.kill(worker.pid, signal.SIGKILL)
        await asyncio.to_thread(worker.join, 10)
        try:
            await asyncio.wait_for(pending, 5)
        except ChannelClosed:
            pass
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(client.send(b"after the kill"), 5)
        # The name went with the process: nobody answers it.
        with pytest.raises(OSError):
            await StepChannelClient.connect(name)

    run(scenario())
    StepChannelServer(name).close()   # and a new worker can take it
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_host_identity_names_this_kernel_and_network_namespace() -> None:
    identity = host_identity()
    with open("/proc/sys/kernel/random/boot_id") as f:
        assert identity.startswith(f.read().strip() + "/")
    assert identity.endswith(f"/{os.stat('/proc/self/ns/net').st_ino}")


def test_calls_run_in_the_serving_thread_between_frames() -> None:
    with serving(lambda frame: frame) as server:
        serving_thread = server.call(threading.get_ident).result(timeout=5)
        assert serving_thread != threading.get_ident()
        failed = server.call(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            failed.result(timeout=5)
        assert server.call(lambda: "still serving").result(timeout=5) == "still serving"
    # After the end nothing runs: a late call is cancelled, not left waiting.
    assert server.call(lambda: "too late").cancelled()
