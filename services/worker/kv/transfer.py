"""The worker's gRPC traffic with kvstore nodes, on a thread of its own with its own event
loop: the model runner hands it loads and saves and never waits on the network.

A load fetches its blocks in order and keeps the prefix that arrived intact: each block must
be the one asked for, of the worker's block size, with the writer's checksum. It ends by its
deadline (kv_load_timeout_s) whatever the store does: a slow store, a node killed mid-stream
or a corrupted block all end as a shorter prefix plus `failed`. A save is best effort: it is
refused at once (reported failed) when the bytes already waiting to be sent exceed the buffer,
so a slow store never grows the worker's memory.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import ssl
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import structlog
from grpclib.client import Channel

from services.common import wire
from services.common.kv_data_plane import GRPC_CONFIG, block_checksum

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class LoadResult:
    handle: int
    payloads: list[bytes]        # the leading blocks that arrived intact
    failed: bool


@dataclass(slots=True)
class SaveResult:
    save_id: int
    ok: bool
    num_bytes: int


class KVTransferThread:
    def __init__(self, fingerprint: str, block_bytes: int, load_timeout_s: float,
                 save_timeout_s: float, save_buffer_bytes: int,
                 tls: ssl.SSLContext | None = None) -> None:
        self.fingerprint = fingerprint
        self.block_bytes = block_bytes
        self.load_timeout_s = load_timeout_s
        self.save_timeout_s = save_timeout_s
        self.save_buffer_bytes = save_buffer_bytes
        self.tls = tls   # the data plane's mutual TLS (kv_data_plane.client_tls)
        self.results: queue.SimpleQueue[LoadResult | SaveResult] = queue.SimpleQueue()
        self.has_results = threading.Event()
        self._save_bytes_in_flight = 0     # touched by the caller's thread only
        self._loop = asyncio.new_event_loop()
        self._channels: dict[str, Channel] = {}
        self._thread = threading.Thread(target=self._loop.run_forever, name="kv-transfer",
                                        daemon=True)
        self._thread.start()

    # ---- called from the model runner's thread
    def load(self, handle: int, block_hashes: Sequence[bytes],
             nodes: Sequence[str]) -> Future[None]:
        return asyncio.run_coroutine_threadsafe(
            self._load(handle, list(block_hashes), list(nodes)), self._loop)

    def save(self, save_id: int, node: str, block_hashes: Sequence[bytes],
             payloads: np.ndarray) -> None:
        """Puts blocks (payloads: uint8 [blocks, block bytes], a copy the caller gives up)."""
        num_bytes = payloads.nbytes
        if self._save_bytes_in_flight + num_bytes > self.save_buffer_bytes:
            self._put(SaveResult(save_id, False, 0))   # the store is behind: drop it
            return
        self._save_bytes_in_flight += num_bytes
        asyncio.run_coroutine_threadsafe(
            self._save(save_id, node, list(block_hashes), payloads, num_bytes), self._loop)

    def take_results(self) -> list[LoadResult | SaveResult]:
        self.has_results.clear()
        results = []
        while True:
            try:
                result = self.results.get_nowait()
            except queue.Empty:
                return results
            if isinstance(result, SaveResult):
                self._save_bytes_in_flight -= result.num_bytes
            results.append(result)

    def close(self) -> None:
        async def close_channels() -> None:
            for channel in self._channels.values():
                channel.close()

        asyncio.run_coroutine_threadsafe(close_channels(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    # ---- on the transfer thread
    async def _load(self, handle: int, block_hashes: list[bytes], nodes: list[str]) -> None:
        payloads: list[bytes] = []
        failed = True
        try:
            async with asyncio.timeout(self.load_timeout_s):
                failed = not await self._fetch(block_hashes, nodes, payloads)
        except asyncio.CancelledError:
            raise   # the request ended: nobody wants the result
        except TimeoutError:
            log.warning("KV load timed out", handle=handle, timeout_s=self.load_timeout_s,
                        num_blocks=len(block_hashes), num_received=len(payloads))
        except Exception as exc:   # the node went away, refused, or broke the stream
            log.warning("KV load failed", handle=handle, error=str(exc) or type(exc).__name__,
                        num_received=len(payloads))
        self._put(LoadResult(handle, payloads, failed))

    async def _fetch(self, block_hashes: list[bytes], nodes: list[str],
                     payloads: list[bytes]) -> bool:
        """Appends verified blocks in order; False at the first block missing or damaged."""
        position = 0
        for node, run in itertools.groupby(zip(block_hashes, nodes), key=lambda bn: bn[1]):
            hashes = [block_hash for block_hash, _ in run]
            end = position + len(hashes)
            stub = wire.KvStoreStub(self._channel(node))
            async for block in stub.get(wire.GetRequest(fingerprint=self.fingerprint,
                                                        block_hashes=hashes)):
                if (position == end or block.block_hash != block_hashes[position]
                        or len(block.data) != self.block_bytes
                        or block_checksum(block.data) != block.checksum):
                    log.warning("KV block damaged; the rest is recomputed", node=node,
                                block=position, size=len(block.data))
                    return False
                payloads.append(block.data)
                position += 1
            if position < end:
                return False   # the node no longer holds the rest
        return True

    async def _save(self, save_id: int, node: str, block_hashes: list[bytes],
                    payloads: np.ndarray, num_bytes: int) -> None:
        ok = False
        try:
            blocks = [payload.tobytes() for payload in payloads]
            messages = [wire.PutBlock(block_hash=h, data=b, checksum=block_checksum(b))
                        for h, b in zip(block_hashes, blocks)]
            messages[0].fingerprint = self.fingerprint
            reply = await wire.KvStoreStub(self._channel(node)).put(
                messages, timeout=self.save_timeout_s)
            ok = reply.num_stored == len(messages)
        except Exception as exc:
            log.warning("KV save failed", node=node, error=str(exc) or type(exc).__name__,
                        num_blocks=len(block_hashes))
        self._put(SaveResult(save_id, ok, num_bytes))

    def _channel(self, node: str) -> Channel:
        channel = self._channels.get(node)
        if channel is None:
            host, _, port = node.rpartition(":")
            channel = Channel(host.strip("[]"), int(port), ssl=self.tls, config=GRPC_CONFIG)
            self._channels[node] = channel
        return channel

    def _put(self, result: LoadResult | SaveResult) -> None:
        self.results.put(result)
        self.has_results.set()
