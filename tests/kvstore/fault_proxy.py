"""A kvstore stand-in for fault tests: a gRPC proxy (its own thread and event loop) that
forwards to a real kvstore node and, on Get, can flip a byte of one block, stream slowly, or
break off when the node behind it dies. A kvstore advertising the proxy's address
(--advertise-address) sends every engine's traffic through it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpclib
from grpclib.client import Channel
from grpclib.server import Server

from services.common.ports import free_port
from services.common import wire
from services.common.kv_data_plane import GRPC_CONFIG


@dataclass
class Faults:
    corrupt_block: int | None = None   # Get: flip a byte of the block at this position
    delay_per_block_s: float = 0.0     # Get: pause before each block
    num_gets: int = 0                  # Get calls seen (to know a load has started)


class FaultProxy(wire.KvStoreBase):
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.faults = Faults()
        self._loop = asyncio.new_event_loop()
        self._channel: Channel | None = None
        self._server: Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        self._channel = Channel("127.0.0.1", self.upstream_port, config=GRPC_CONFIG)
        self._server = Server([self], config=GRPC_CONFIG)
        await self._server.start("127.0.0.1", self.port)

    async def _stop(self) -> None:
        assert self._server is not None and self._channel is not None
        self._server.close()
        await self._server.wait_closed()
        self._channel.close()

    @property
    def _upstream(self) -> wire.KvStoreStub:
        assert self._channel is not None
        return wire.KvStoreStub(self._channel)

    async def put(self, put_block_iterator: AsyncIterator[wire.PutBlock]) -> wire.PutReply:
        blocks = [block async for block in put_block_iterator]
        return await self._upstream.put(blocks)

    async def get(self, get_request: wire.GetRequest) -> AsyncIterator[wire.StoredBlock]:
        self.faults.num_gets += 1
        faults = self.faults
        try:
            position = 0
            async for block in self._upstream.get(get_request):
                if faults.delay_per_block_s:
                    await asyncio.sleep(faults.delay_per_block_s)
                if position == faults.corrupt_block:
                    block.data = bytes([block.data[0] ^ 0xFF]) + block.data[1:]
                position += 1
                yield block
        except (OSError, grpclib.exceptions.StreamTerminatedError) as exc:
            raise grpclib.GRPCError(grpclib.Status.UNAVAILABLE, f"kvstore gone: {exc}") from exc

    async def lookup(self, lookup_request: wire.LookupRequest) -> wire.LookupReply:
        return await self._upstream.lookup(lookup_request)

    async def delete(self, delete_request: wire.DeleteRequest) -> wire.DeleteReply:
        return await self._upstream.delete(delete_request)
