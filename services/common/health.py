"""The small HTTP server every service runs: /health, /ready and /metrics.

/health: the process and its event loop answer (liveness). /ready: the service can make
forward progress now (NATS connected, model loaded, its loop not stuck) — orchestrators
route around a service that is not ready. /metrics: Prometheus text format.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = structlog.get_logger(__name__)

Check = Callable[[], tuple[bool, str]]


class HealthServer:
    def __init__(self, host: str, port: int, readiness: Check,
                 registry: CollectorRegistry) -> None:
        self.host = host
        self.port = port
        self._readiness = readiness
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            status, content_type, body = self._route(path)
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode() + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, path: str) -> tuple[str, str, bytes]:
        if path == "/health":
            return "200 OK", "application/json", b'{"status":"ok"}'
        if path == "/ready":
            ready, reason = self._readiness()
            body = json.dumps({"ready": ready, "reason": reason}).encode()
            return ("200 OK" if ready else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, generate_latest(self._registry)
        return "404 Not Found", "application/json", b'{"error":"not found"}'
