"""The local step channel: a scheduler and its worker on one host exchange steps over a Unix
stream socket in Linux's abstract namespace, with no broker and no event loop on the
worker's side.

Why a socket and not a shared-memory ring (docs/architecture.md, the step plane): on two
cores neither side may spin while it waits (the worker's forward pass needs both cores, and
the scheduler waits through it), so each step needs a kernel wake-up either way; a socket is
that wake-up with the bytes in it (docs/benchmarks.md measures its round trip). And the
abstract namespace gives the rest for free:
- nothing on disk or in /dev/shm: the kernel drops the name with the worker's socket, on a
  SIGKILL too;
- its names are scoped to a network namespace, so a worker on another host or in another
  container cannot be reached, and the scheduler steps it over NATS instead;
- a side that dies closes the connection, so the other learns it at once.

A frame is a little-endian u32 length and that many bytes (a serialized StepInput or
StepOutput). The worker answers steps in order, so a scheduler may send the next step
before the last one's answer arrives (async scheduling).

The server runs in the worker's one step thread, which also runs whatever else must run
there (`call`: steps that came over NATS). NOTE: one thread for every step, the one that
loaded and warmed the model. Measured in the mesh: steps run from a second thread took
35-40% longer (docs/benchmarks.md 10q). Each thread that runs torch ops has an OpenMP team
of its own, and a process holding more OpenMP threads than cores has libgomp throttle its
spinning at barriers: the likely cause.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import NamedTuple, TypeVar, cast

_HEADER = struct.Struct("<I")
T = TypeVar("T")


class Reply(NamedTuple):
    frame: bytes
    received_at: float   # time.perf_counter() when it arrived, before the loop got to it


class ChannelClosed(ConnectionError):
    """The other side closed the channel (it stopped or died) with steps unanswered."""


def host_identity() -> str:
    """Who can reach whose abstract sockets: one kernel (its boot id) and one network
    namespace (its inode). Workers advertise it; a scheduler compares it with its own."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""   # not Linux: no local channel
    return f"{boot_id}/{netns}"


def _abstract(name: str) -> bytes:
    return b"\0" + name.encode()


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    """`size` bytes from a blocking socket; None when it closes first."""
    data = sock.recv(size, socket.MSG_WAITALL)
    return data if len(data) == size else None


class StepChannelServer:
    """The worker's end: listens on `name` and answers each frame with `handle(frame)`, in
    the thread that calls `serve` (the worker's step thread), and runs there what other
    threads `call`. One scheduler at a time: a new connection replaces the one before (a
    scheduler that restarted)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(_abstract(name))
        self._listener.listen(4)
        self._listener.setblocking(False)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._stopped = threading.Event()
        self._calls: deque[tuple[Callable[[], object], Future[object]]] = deque()
        self._calls_lock = threading.Lock()   # a call is queued before the end, or cancelled

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Runs `fn` in the serving thread, between frames; its result or exception arrives
        in the future (cancelled if the server stops first)."""
        future: Future[T] = Future()
        with self._calls_lock:
            if self._stopped.is_set():
                future.cancel()
                return future
            self._calls.append((fn, cast(Future[object], future)))
        self._wake()
        return future

    def serve(self, handle: Callable[[bytes], bytes]) -> None:
        """Answers frames until `stop()`. `handle` must not raise for a bad step: it answers
        with the error (the worker's ModelRunner.execute does)."""
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        selector.register(self._wake_reader, selectors.EVENT_READ)
        peer: socket.socket | None = None
        try:
            while not self._stopped.is_set():
                for key, _ in selector.select():
                    if key.fileobj is self._wake_reader:
                        self._run_calls()
                    elif key.fileobj is self._listener:
                        accepted, _ = self._listener.accept()
                        accepted.setblocking(True)
                        if peer is not None:
                            selector.unregister(peer)
                            peer.close()
                        peer = accepted
                        selector.register(peer, selectors.EVENT_READ)
                    elif key.fileobj is peer and not self._answer(peer, handle):
                        selector.unregister(peer)
                        peer.close()
                        peer = None
        finally:
            if peer is not None:
                peer.close()
            selector.close()
            self.close()
            with self._calls_lock:
                self._stopped.set()
                while self._calls:
                    self._calls.popleft()[1].cancel()

    def _run_calls(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass
        while self._calls:
            fn, future = self._calls.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)

    @staticmethod
    def _answer(peer: socket.socket, handle: Callable[[bytes], bytes]) -> bool:
        """Reads one frame and sends its answer; False when the peer has gone."""
        try:
            header = _recv_exactly(peer, _HEADER.size)
            frame = header and _recv_exactly(peer, _HEADER.unpack(header)[0])
            if frame is None:
                return False
            reply = handle(frame)
            peer.sendall(_HEADER.pack(len(reply)) + reply)
        except OSError:
            return False
        return True

    def stop(self) -> None:
        """Ends `serve`, from any thread; it frees the name as it returns."""
        self._stopped.set()
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:
            pass   # serve has returned already (or its wake-up buffer is full: it wakes)

    def close(self) -> None:
        """Frees the name (`serve` does it as it returns; call it where serve never ran)."""
        self._listener.close()
        self._wake_reader.close()
        self._wake_writer.close()


class StepChannelClient(asyncio.Protocol):
    """The scheduler's end, on its event loop: `send` a frame, await the answer. Answers
    come in the order the frames went."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._pending: deque[asyncio.Future[Reply]] = deque()
        self._closed = False

    @classmethod
    async def connect(cls, name: str) -> StepChannelClient:
        """Connects to a worker's channel; OSError when nobody listens on `name` here."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(_abstract(name))   # a local listener accepts at once
            sock.setblocking(False)
            _, client = await asyncio.get_running_loop().create_unix_connection(cls, sock=sock)
        except BaseException:
            sock.close()
            raise
        return client

    @property
    def is_open(self) -> bool:
        return not self._closed

    def send(self, frame: bytes) -> asyncio.Future[Reply]:
        """Sends a frame; the future holds its answer, or ChannelClosed."""
        future = asyncio.get_running_loop().create_future()
        if self._closed or self._transport is None:
            future.set_exception(ChannelClosed("the local step channel is closed"))
            return future
        self._pending.append(future)
        self._transport.write(_HEADER.pack(len(frame)) + frame)
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # ---- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # NOTE: uvloop's transports do not subclass asyncio.Transport; they write all the same.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        received_at = time.perf_counter()
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + size
            if len(self._buffer) < end:
                return
            frame = bytes(self._buffer[_HEADER.size:end])
            del self._buffer[:end]
            if self._pending:
                future = self._pending.popleft()
                if not future.done():   # NOTE: its waiter may have given up on it
                    future.set_result(Reply(frame, received_at))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        while self._pending:
            future = self._pending.popleft()
            if not future.done():
                future.set_exception(ChannelClosed(
                    "the worker closed the local step channel"
                    + (f": {exc}" if exc is not None else "")))
