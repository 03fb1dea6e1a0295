"""The kvstore data plane over mutual TLS, real gRPC both ways: a worker with a certificate
from the CA saves and loads blocks; a client without one, a plain-TCP client and a node the
worker's CA did not sign are refused."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import trustme

from services.common import wire
from services.common.kv_data_plane import KVTLSSettings, client_tls, server_tls
from services.worker.kv.transfer import KVTransferThread, LoadResult, SaveResult
from tests.kvstore.conftest import running_servicer, stub_for
from tests.pki import issue

FP = "model-tls"
BLOCK_BYTES = 4096


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, KVTLSSettings]]:
    """The settings of a node and a worker from one CA, and of a worker from another."""
    files = tmp_path_factory.mktemp("kv-pki")

    def issued(ca: trustme.CA, name: str, identity: str) -> KVTLSSettings:
        return KVTLSSettings(*issue(ca, identity, files, name))

    ca, other_ca = trustme.CA(), trustme.CA()
    yield {"node": issued(ca, "node", "127.0.0.1"), "worker": issued(ca, "worker", "worker"),
           "stranger": issued(other_ca, "stranger", "worker")}


def blocks(n: int) -> list[tuple[bytes, bytes]]:
    return [(f"tls-{i}".encode().ljust(32, b"."), os.urandom(BLOCK_BYTES)) for i in range(n)]


async def results_of(transfer: KVTransferThread) -> list[LoadResult | SaveResult]:
    while not transfer.has_results.is_set():
        await asyncio.sleep(0.01)
    return transfer.take_results()


async def test_a_worker_with_the_cas_certificate_saves_and_loads(
        pki: dict[str, KVTLSSettings]) -> None:
    items = blocks(3)
    transfer = KVTransferThread(FP, BLOCK_BYTES, load_timeout_s=5.0, save_timeout_s=5.0,
                                save_buffer_bytes=1 << 20, tls=client_tls(pki["worker"]))
    async with running_servicer(cpu_bytes=1 << 20, tls=server_tls(pki["node"])) as (_, node):
        try:
            payloads = np.frombuffer(b"".join(d for _, d in items), np.uint8).reshape(3, -1)
            transfer.save(1, node, [h for h, _ in items], payloads.copy())
            assert await results_of(transfer) == [SaveResult(1, True, payloads.nbytes)]
            await asyncio.wrap_future(transfer.load(7, [h for h, _ in items], [node] * 3))
            [loaded] = await results_of(transfer)
            assert loaded == LoadResult(7, [d for _, d in items], failed=False)
        finally:
            transfer.close()


@pytest.mark.parametrize("client", ["no certificate", "plain TCP", "another CA"])
async def test_the_node_and_worker_refuse_whoever_the_ca_did_not_sign(
        pki: dict[str, KVTLSSettings], client: str) -> None:
    worker = pki["worker"]
    tls = {"no certificate": client_tls(KVTLSSettings(kv_tls_ca_file=worker.kv_tls_ca_file)),
           "plain TCP": None,
           # A worker trusting another CA: the node's certificate is not one it accepts.
           "another CA": client_tls(pki["stranger"])}[client]
    async with running_servicer(cpu_bytes=1 << 20, tls=server_tls(pki["node"])) as (_, node):
        async with stub_for(node, tls) as stub:
            with pytest.raises(Exception) as refused:   # noqa: B017 - at the handshake or stream
                await asyncio.wait_for(
                    stub.lookup(wire.LookupRequest(fingerprint=FP, block_hashes=[b"x" * 32])),
                    timeout=10.0)
            assert not isinstance(refused.value, TimeoutError), "not refused, just no answer"


def test_a_node_without_a_certificate_serves_plain_tcp_and_bad_files_say_which_flag(
        pki: dict[str, KVTLSSettings], tmp_path: Path) -> None:
    assert server_tls(KVTLSSettings()) is None and client_tls(KVTLSSettings()) is None
    with pytest.raises(ValueError, match="--kv-tls-ca-file"):
        client_tls(KVTLSSettings(kv_tls_ca_file=str(tmp_path / "missing.pem")))
