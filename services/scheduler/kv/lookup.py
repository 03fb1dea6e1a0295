"""The KV connector's I/O on the scheduler side: the Redis index lookup at admission and the
list of live kvstore nodes.

A request is looked up once, before it enters the waiting queue, so schedule() only reads the
result (Request.kv_store_hit). A lookup costs one or two pipelined Redis round trips; it is
bounded by a timeout, and a failed lookup turns lookups off for a while, so a slow or dead
Redis delays admissions by at most one timeout and never stops the engine.
"""

from __future__ import annotations

import asyncio
import time

import structlog

from services.common.kv_index import KVIndex
from services.scheduler.core.request import Request

_BACKOFF_S = 5.0            # after a failed lookup, admit without lookups this long
_NODES_REFRESH_S = 1.0


class KVStoreLookup:
    def __init__(self, index: KVIndex, block_size: int, timeout_s: float,
                 log: structlog.stdlib.BoundLogger) -> None:
        self.index = index
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.log = log
        self.fingerprint = ""            # the worker's; set when it joins
        self.live_nodes: list[str] = []  # kvstore addresses, refreshed in the background
        self.num_query_tokens = 0        # cumulative, for vllm:external_prefix_cache_queries
        self._off_until = 0.0
        self._refresher: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._refresher = asyncio.create_task(self._refresh_nodes())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self.index.close()

    async def lookup(self, request: Request, num_local_blocks: int) -> None:
        """Sets request.kv_store_hit: where the store holds the request's leading blocks.
        Skipped when the local prefix cache already covers every block that could load."""
        num_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        if (num_blocks <= num_local_blocks or request.skip_prefix_cache or not self.fingerprint
                or not self.live_nodes or time.monotonic() < self._off_until):
            return
        try:
            nodes = await asyncio.wait_for(
                self.index.lookup_prefix(self.fingerprint, request.block_hashes[:num_blocks]),
                self.timeout_s)
        except Exception as exc:   # Redis down or slow: serve without the store for a while
            self._off_until = time.monotonic() + _BACKOFF_S
            self.log.warning("kvstore lookup failed; admitting without it for a while",
                             error=str(exc) or type(exc).__name__, backoff_s=_BACKOFF_S)
            return
        self.num_query_tokens += request.num_tokens
        request.kv_store_hit = nodes

    async def _refresh_nodes(self) -> None:
        was_reachable = True
        while True:
            try:
                self.live_nodes = sorted((await asyncio.wait_for(
                    self.index.live_nodes(), self.timeout_s)).values())
                was_reachable = True
            except Exception as exc:
                self.live_nodes = []   # no nodes: no loads and no saves until Redis is back
                if was_reachable:
                    self.log.warning("kvstore index unreachable", error=str(exc) or
                                     type(exc).__name__)
                was_reachable = False
            await asyncio.sleep(_NODES_REFRESH_S)
