"""Fixtures for the kvstore tests: an embedded Redis-protocol server (valkey-server), and a
kvstore servicer on a loopback gRPC port inside the test's event loop."""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from grpclib.client import Channel
from grpclib.server import Server
from prometheus_client import CollectorRegistry

from llm_mesh.embedded import EmbeddedRedis
from services.common import wire
from services.common.kv_data_plane import GRPC_CONFIG
from services.common.kv_index import KVIndex
from services.common.metrics import KVStoreMetrics
from services.kvstore.block_store import BlockStore
from services.kvstore.servicer import KVStoreServicer
from services.kvstore.tiers import DiskTier


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(password="s3cret") as server:
        yield server


@asynccontextmanager
async def running_servicer(cpu_bytes: int, node_id: str = "node-a",
                           index: KVIndex | None = None, disk_dir: Path | None = None,
                           disk_bytes: int = 0, tls: ssl.SSLContext | None = None
                           ) -> AsyncIterator[tuple[KVStoreServicer, str]]:
    """A servicer serving gRPC on loopback; yields it and its host:port."""
    disk = DiskTier(disk_dir, disk_bytes) if disk_dir is not None else None
    servicer = KVStoreServicer(BlockStore(cpu_bytes, disk), node_id,
                               KVStoreMetrics(CollectorRegistry()), index, index_ttl_s=60.0)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = Server([servicer], config=GRPC_CONFIG)
    await server.start(sock=sock, ssl=tls)
    try:
        yield servicer, f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def stub_for(address: str,
                   tls: ssl.SSLContext | None = None) -> AsyncIterator[wire.KvStoreStub]:
    host, port = address.rsplit(":", 1)
    channel = Channel(host, int(port), ssl=tls, config=GRPC_CONFIG)
    try:
        yield wire.KvStoreStub(channel)
    finally:
        channel.close()
