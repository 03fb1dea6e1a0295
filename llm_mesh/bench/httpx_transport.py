"""The same transport interface over httpx2 (`--http-client httpx2`): slower per chunk than
raw_http (see its docstring) but with everything a full client has (proxies, HTTP/2, ...)."""

from __future__ import annotations

import time
from collections.abc import Mapping

import httpx2

from llm_mesh.bench.raw_http import OnData


class HttpxTransport:
    def __init__(self, base_url: str, headers: dict[str, str], max_connections: int,
                 timeout_s: float) -> None:
        self._http = httpx2.AsyncClient(
            base_url=base_url.rstrip("/"), headers=headers,
            limits=httpx2.Limits(max_connections=max_connections,
                                 max_keepalive_connections=max_connections),
            timeout=httpx2.Timeout(timeout_s, connect=min(timeout_s, 30.0)))

    async def post_stream(self, path: str, body: bytes, on_data: OnData,
                          headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        clock = time.perf_counter
        async with self._http.stream("POST", path, content=body, headers=headers) as response:
            if response.status_code != 200:
                return response.status_code, await response.aread()
            async for data in response.aiter_raw():  # raw: we asked for identity encoding
                on_data(data, clock())
        return 200, b""

    async def get(self, path: str) -> tuple[int, bytes]:
        response = await self._http.get(path, timeout=30.0)
        return response.status_code, response.content

    async def aclose(self) -> None:
        await self._http.aclose()
