"""Connecting to NATS as a service does: it waits for a server that is not up yet, and gives
up with an error that names the address when none comes within its deadline; a service
process then exits with that reason in one log line."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llm_mesh.embedded import EmbeddedNats
from services.common.ports import free_port
from services.common.bus import Bus, BusError
from tests.mesh import REPO_ROOT


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


async def test_a_list_of_urls_connects_to_a_live_one() -> None:
    """A cluster's nodes as one comma-separated --nats-url: a dead first node is skipped."""
    dead = free_port()
    with EmbeddedNats() as server:
        bus = await Bus.connect(f"nats://127.0.0.1:{dead}, {server.url}", "cluster-client",
                                retry_for_s=30)
        try:
            assert bus.client.connected_url is not None
            assert bus.client.connected_url.port == server.port
        finally:
            await bus.close()


async def test_without_a_server_connecting_fails_at_its_deadline_with_the_address() -> None:
    port = free_port()
    with pytest.raises(BusError) as refused:
        await Bus.connect(f"nats://user:secret@127.0.0.1:{port}", "lonely", retry_for_s=1.0)
    message = str(refused.value)
    assert f"127.0.0.1:{port}" in message and "within 1 s" in message
    assert "secret" not in message   # credentials stay out of errors and logs
    with pytest.raises(BusError) as refused:
        await Bus.connect(f"nats://a:b@127.0.0.1:{port},nats://c:secret@127.0.0.1:{port + 1}",
                          "lonely", retry_for_s=1.0)
    assert "secret" not in str(refused.value) and f"127.0.0.1:{port + 1}" in str(refused.value)


def test_a_service_that_cannot_reach_nats_exits_with_the_reason(tmp_path: Path) -> None:
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "services.tokenizer", "--nats-url", f"nats://127.0.0.1:{port}",
         "--nats-connect-timeout-s", "1", "--log-format", "json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    [line] = [json.loads(x) for x in done.stdout.splitlines() + done.stderr.splitlines()
              if '"cannot join the mesh"' in x]
    assert f"127.0.0.1:{port}" in line["error"] and line["level"] == "error"
    assert "Traceback" not in done.stderr
