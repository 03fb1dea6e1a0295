"""Liveness probes for `llm-mesh up`: is a child process still answering, or hung?

A service is alive when its health server answers /health (never /ready: a worker loading
its model, or a scheduler waiting for its worker, is alive but not ready); nats-server when
it greets a new connection with its INFO line; valkey-server when it answers PING. A
process is hung when no probe succeeded for `timeout_s` — counted from the later of its
start and its last answer — or, before its first answer (imports, model loading), for the
longer `grace_s`, unless /proc says it is stopped (SIGSTOP), which is a hang from the start.
"""

from __future__ import annotations

import http.client
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

Probe = Callable[[float], bool]
"""Asks a process once, waiting at most the given seconds: True when it answered."""

PROBE_INTERVAL_S = 1.0


def http_probe(host: str, port: int) -> Probe:
    def probe(timeout_s: float) -> bool:
        connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
        try:
            connection.request("GET", "/health")
            return connection.getresponse().status == 200
        except (OSError, http.client.HTTPException):   # refused, reset, timed out, garbled
            return False
        finally:
            connection.close()
    return probe


def nats_probe(host: str, port: int) -> Probe:
    # NOTE: nats-server sends INFO to every new client before it logs in, so no credentials.
    return _line_probe(host, port, b"", (b"INFO ",))


def redis_probe(host: str, port: int) -> Probe:
    # NOTE: with a password set, PING before AUTH is refused with -NOAUTH: still an answer.
    return _line_probe(host, port, b"PING\r\n", (b"+PONG", b"-NOAUTH"))


def _line_probe(host: str, port: int, send: bytes, answers: tuple[bytes, ...]) -> Probe:
    """Connects, sends `send`, and expects a line starting with one of `answers`."""
    def probe(timeout_s: float) -> bool:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                sock.sendall(send)
                line = sock.makefile("rb").readline(4096)
        except OSError:
            return False
        return line.startswith(answers)
    return probe


def is_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, state T) or stopped by a tracer (t)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


class Liveness:
    """One child's probes, run about every second on a shared pool so the supervisor never
    waits on them, and the verdict: `silent_s()` is how long the child has been silent once
    that makes it hung, else None."""

    def __init__(self, probe: Probe, pool: ThreadPoolExecutor, timeout_s: float,
                 grace_s: float) -> None:
        self._probe = probe
        self._pool = pool
        self._timeout_s = timeout_s
        self._grace_s = max(grace_s, timeout_s)
        self._pid = 0
        self._started = 0.0
        self._last_answer: float | None = None
        self._last_probe = 0.0
        self._pending: Future[bool] | None = None

    def restarted(self, pid: int) -> None:
        """A new process now runs: forget the old one's answers and its probe in flight."""
        self._pid = pid
        self._started = time.monotonic()
        self._last_answer = None
        self._pending = None

    def silent_s(self) -> float | None:
        now = time.monotonic()
        if self._pending is not None and self._pending.done():
            if self._pending.result():
                self._last_answer = now
            self._pending = None
        if self._pending is None and now - self._last_probe >= PROBE_INTERVAL_S:
            # NOTE: one probe may wait the whole timeout: an answer that comes late under a
            # CPU hog still proves the process alive, and the verdict below never waits on it.
            self._pending = self._pool.submit(self._probe, self._timeout_s)
            self._last_probe = now
        silent = now - (self._started if self._last_answer is None else self._last_answer)
        never_answered = self._last_answer is None and not is_stopped(self._pid)
        return silent if silent >= (self._grace_s if never_answered else self._timeout_s) else None
