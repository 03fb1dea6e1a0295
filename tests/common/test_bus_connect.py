"""Connecting to NATS as a service does: it waits for a server that is not up yet, and gives
up with an error that names the address when none comes within its deadline."""

from __future__ import annotations

import asyncio

import pytest

from llm_mesh.embedded import EmbeddedNats, free_port
from services.common.bus import Bus, BusError


async def test_a_service_waits_for_nats_to_come_up() -> None:
    server = EmbeddedNats()
    connecting = asyncio.create_task(Bus.connect(server.url, "early-service", retry_for_s=30))
    await asyncio.sleep(0)   # the first attempts fail: nothing listens yet
    assert not connecting.done()
    await asyncio.to_thread(server.start)
    bus = await connecting
    try:
        assert bus.is_connected
    finally:
        await bus.close()
        server.stop()


async def test_without_a_server_connecting_fails_at_its_deadline_with_the_address() -> None:
    port = free_port()
    with pytest.raises(BusError) as refused:
        await Bus.connect(f"nats://user:secret@127.0.0.1:{port}", "lonely", retry_for_s=1.0)
    message = str(refused.value)
    assert f"127.0.0.1:{port}" in message and "within 1 s" in message
    assert "secret" not in message   # credentials stay out of errors and logs
