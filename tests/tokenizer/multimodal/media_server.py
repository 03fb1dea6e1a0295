"""A local HTTP server for fetch tests: serves a few fixed routes on a random loopback port
and records every request it receives (path and Host header)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class MediaServer:
    port: int = 0
    # path -> (body, declare Content-Length?)
    files: dict[str, tuple[bytes, bool]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)   # (path, Host)
    release: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(server: MediaServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            server.requests.append((self.path, self.headers.get("Host", "")))
            parts = urlsplit(self.path)
            if parts.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", parse_qs(parts.query)["to"][0])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif parts.path == "/stall":
                server.release.wait()          # until the test is over
                self.send_response(204)
                self.end_headers()
            elif parts.path in server.files:
                body, declare_length = server.files[parts.path]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                if declare_length:      # NOTE: else HTTP/1.0's end of connection ends it
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

    return Handler


@contextmanager
def media_server() -> Iterator[MediaServer]:
    state = MediaServer()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    state.port = httpd.server_address[1]
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join()
