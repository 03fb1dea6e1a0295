"""A minimal HTTP/1.1 client for streamed POSTs: keep-alive pool, chunked decoding.

Why not httpx2: measured against a stub streaming one token per chunk at ~3,000 chunks/s
(64 streams), httpx2 cost ~80 µs of client CPU per chunk and this ~20 µs. On a 2-core
machine the client shares the CPUs with the server it measures, so that difference is
throughput taken from the server. httpx2 stays available (`--http-client httpx2`).

Scope: HTTP/1.1 (TLS through asyncio), bodies framed by chunked encoding, Content-Length
or connection close. No redirects, proxies or compression (we send Accept-Encoding:
identity).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

OnData = Callable[[bytes, float], None]
READ_SIZE = 1 << 16


class ChunkedDecoder:
    """Incremental `Transfer-Encoding: chunked` decoder; `is_done` after the last chunk."""

    def __init__(self) -> None:
        self.is_done = False
        self._buffer = b""
        self._in_trailer = False

    def feed(self, data: bytes) -> bytes:
        buf = self._buffer + data if self._buffer else data
        out: list[bytes] = []
        pos = 0
        while not self.is_done:
            if self._in_trailer:  # after the 0-size chunk: optional trailers, then an empty line
                if buf.startswith(b"\r\n", pos):
                    pos, self.is_done = pos + 2, True
                elif (end := buf.find(b"\r\n\r\n", pos)) >= 0:
                    pos, self.is_done = end + 4, True
                break
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)  # ValueError: broken framing
            if size == 0:
                self._in_trailer, pos = True, eol + 2
                continue
            end = eol + 2 + size
            if len(buf) < end + 2:
                break
            out.append(buf[eol + 2:end])
            pos = end + 2
        self._buffer = buf[pos:]
        return out[0] if len(out) == 1 else b"".join(out)


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    def close(self) -> None:
        self.writer.close()


class _StaleConnection(Exception):
    """A pooled connection the server had already closed: retried once on a fresh one."""


class RawHttpTransport:
    def __init__(self, base_url: str, headers: dict[str, str], max_connections: int,
                 timeout_s: float) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https"):
            raise ValueError(f"--base-url {base_url!r}: only http:// and https:// are supported")
        self.host = url.hostname or "127.0.0.1"
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self._prefix = url.path.rstrip("/")
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        host_header = self.host if url.port is None else f"{self.host}:{url.port}"
        self._head_lines = "".join(f"{k}: {v}\r\n" for k, v in
                                   {"Host": host_header, **headers}.items())
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)
        self._timeout_s = timeout_s

    async def post_stream(self, path: str, body: bytes, on_data: OnData,
                          headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """POSTs `body` (with `headers` besides the client's own); a 200 body is handed to
        `on_data` as it arrives (stamped with perf_counter), any other status returns with its
        body. Network errors raise."""
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (f"POST {self._prefix}{path} HTTP/1.1\r\n{self._head_lines}{extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        async with self._slots:
            async with asyncio.timeout(self._timeout_s):  # NOTE: not counting the slot wait
                try:
                    return await self._exchange(head + body, on_data, reuse=True)
                except _StaleConnection:
                    return await self._exchange(head + body, on_data, reuse=False)

    async def get(self, path: str) -> tuple[int, bytes]:
        head = f"GET {self._prefix}{path} HTTP/1.1\r\n{self._head_lines}\r\n".encode()
        chunks: list[bytes] = []
        async with self._slots, asyncio.timeout(min(self._timeout_s, 30.0)):
            status, _ = await self._exchange(head, lambda data, _: chunks.append(data),
                                             reuse=False)
        return status, b"".join(chunks)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()

    async def _exchange(self, request: bytes, on_data: OnData, reuse: bool) -> tuple[int, bytes]:
        conn, is_reused = await self._acquire(reuse)
        keep = False
        try:
            conn.writer.write(request)
            try:
                raw_head = await conn.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if is_reused:
                    raise _StaleConnection from exc
                raise
            status, headers = _parse_head(raw_head)
            if status == 200:
                keep = await self._read_body(conn, headers, on_data)
                return status, b""
            error: list[bytes] = []
            keep = await self._read_body(conn, headers, lambda data, _: error.append(data))
            return status, b"".join(error)
        finally:
            if keep:
                self._idle.append(conn)
            else:
                conn.close()

    async def _acquire(self, reuse: bool) -> tuple[_Connection, bool]:
        while reuse and self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn, True
            conn.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, ssl=self._ssl,
                                                       limit=READ_SIZE)
        return _Connection(reader, writer), False

    @staticmethod
    async def _read_body(conn: _Connection, headers: dict[str, str], on_data: OnData) -> bool:
        """Reads the body to its end; returns whether the connection can be reused."""
        clock, reader = time.perf_counter, conn.reader
        if "chunked" in headers.get("transfer-encoding", ""):
            decoder = ChunkedDecoder()
            while not decoder.is_done:
                data = await reader.read(READ_SIZE)
                if not data:
                    raise ConnectionError("the server closed the stream mid-response")
                now = clock()
                if payload := decoder.feed(data):
                    on_data(payload, now)
            return headers.get("connection", "") != "close"
        if (length := headers.get("content-length")) is not None:
            remaining = int(length)
            while remaining > 0:
                data = await reader.read(min(remaining, READ_SIZE))
                if not data:
                    raise ConnectionError("the server closed the connection mid-body")
                remaining -= len(data)
                on_data(data, clock())
            return headers.get("connection", "") != "close"
        while data := await reader.read(READ_SIZE):  # framed by the connection closing
            on_data(data, clock())
        return False


def _parse_head(raw: bytes) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ConnectionError(f"not an HTTP response: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip().lower()
    return int(parts[1]), headers
