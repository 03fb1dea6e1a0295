"""NATS over TLS against a real nats-server that requires TLS and verifies clients: a
service's settings (CA file, client certificate) get it onto the bus; without them it is
refused with an error that says why, never a hang; a real service process comes up
ready."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from llm_mesh.embedded import EmbeddedNats
from services.common.ports import free_port
from services.common import wire
from services.common.bus import Bus, BusError, nats_tls
from services.common.settings import CommonSettings
from tests.faults.streams import poll
from tests.mesh import ServiceProcess
from tests.pki import issue


class TlsNats(EmbeddedNats):
    """nats-server requiring TLS with a certificate for 127.0.0.1, and a client
    certificate signed by `ca` from every client."""

    def __init__(self, ca: trustme.CA, files: Path) -> None:
        super().__init__()
        self._files = files
        self._ca, self._cert, self._key = issue(ca, "127.0.0.1", files, "server")

    def _config(self) -> Path:
        config = self._files / "nats-tls.conf"
        config.write_text(f"""
tls {{
  cert_file: "{self._cert}"
  key_file: "{self._key}"
  ca_file: "{self._ca}"
  verify: true
}}
""")
        return config


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TlsNats, Path]]:
    """The server, and a directory with client-ca.pem, client.pem and client-key.pem."""
    files = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    issue(ca, "llm-mesh-service", files, "client")
    server = TlsNats(ca, files).start()
    yield server, files
    server.stop()


def settings(server: EmbeddedNats, files: Path, **overrides: str) -> CommonSettings:
    values = {"nats_url": server.url, "nats_tls_ca_file": str(files / "client-ca.pem"),
              "nats_tls_cert_file": str(files / "client.pem"),
              "nats_tls_key_file": str(files / "client-key.pem"), **overrides}
    return CommonSettings(**values)


async def test_a_service_with_the_ca_and_a_client_certificate_talks_over_tls(
        pki: tuple[TlsNats, Path]) -> None:
    server, files = pki
    bus = await Bus.for_settings(settings(server, files), "tls-test", retry_for_s=5.0)
    try:
        assert bus.client.connected_url is not None

        async def echo(beat: wire.Heartbeat) -> wire.Heartbeat:
            return wire.Heartbeat(service=beat.service + "-echo")

        await bus.serve("tls.echo", wire.Heartbeat, echo)
        reply = await bus.request("tls.echo", wire.Heartbeat(service="ping"), wire.Heartbeat,
                                  timeout=5.0)
        assert reply.service == "ping-echo"
    finally:
        await bus.close()


@pytest.mark.parametrize("missing", ["client certificate", "server CA"])
async def test_without_its_certificates_a_service_is_refused_with_a_reason(
        pki: tuple[TlsNats, Path], missing: str) -> None:
    server, files = pki
    wrong = ({"nats_tls_cert_file": "", "nats_tls_key_file": ""}
             if missing == "client certificate" else {"nats_tls_ca_file": ""})
    with pytest.raises(BusError) as refused:
        await Bus.for_settings(settings(server, files, **wrong), "tls-test", retry_for_s=1.0)
    message = str(refused.value)
    assert "cannot reach NATS" in message and "--nats-tls-* files" in message
    if missing == "server CA":   # the server's certificate is not one this service trusts
        assert "CERTIFICATE_VERIFY_FAILED" in message


def test_an_unreadable_certificate_is_a_clear_error(pki: tuple[TlsNats, Path]) -> None:
    server, files = pki
    with pytest.raises(BusError) as refused:
        nats_tls(settings(server, files, nats_tls_ca_file=str(files / "missing.pem")))
    assert "--nats-tls-ca-file" in str(refused.value)


def test_a_service_process_comes_up_ready_over_tls(pki: tuple[TlsNats, Path],
                                                   tmp_path: Path) -> None:
    server, files = pki
    # The batch runner: a whole service (JetStream included) that loads no model.
    runner = ServiceProcess("batch", [
        "--nats-url", server.url, "--nats-tls-ca-file", str(files / "client-ca.pem"),
        "--nats-tls-cert-file", str(files / "client.pem"),
        "--nats-tls-key-file", str(files / "client-key.pem")],
        tmp_path / "batch.log", free_port())
    runner.start({**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        poll(lambda: runner.get("/ready")[0] == 200, 60, "the batch runner to be ready")
    finally:
        assert runner.stop() == 0, runner.log_tail()
