"""The NATS bus: services see typed protobuf messages, never bytes.

Messages are betterproto's (services/common/wire) or, on the step path, the official
runtime's (services/common/wire_pb): the bytes are the same protobuf either way.

Connects with reconnect forever (a restarted NATS server is rejoined without restarting
the service), publishes and requests wire messages, and runs subscription handlers that
receive parsed messages. A handler's exception is logged and never kills the subscription.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import TypeVar

import betterproto
import nats
from google.protobuf.message import Message as PbMessage
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from services.common.settings import CommonSettings
from services.common.tls import tls_context

log = structlog.get_logger(__name__)

Message = betterproto.Message | PbMessage
M = TypeVar("M", betterproto.Message, PbMessage)
R = TypeVar("R", betterproto.Message, PbMessage)


def encode(message: Message) -> bytes:
    return message.SerializeToString() if isinstance(message, PbMessage) else bytes(message)


def decode(message_type: type[M], data: bytes) -> M:
    if issubclass(message_type, PbMessage):
        return message_type.FromString(data)
    return message_type().parse(data)


class BusError(Exception):
    """A request got no answer: nobody listens on the subject, or it timed out."""


class NoResponders(BusError):
    pass


class RequestTimeout(BusError):
    pass


class Bus:
    def __init__(self, client: Client) -> None:
        self.client = client

    @classmethod
    async def for_settings(cls, settings: CommonSettings, name: str, *,
                           retry_for_s: float | None = None) -> Bus:
        """Connects as a service's settings say: URL, TLS, inbox prefix and how long to
        wait (unless `retry_for_s` says otherwise)."""
        if retry_for_s is None:
            retry_for_s = settings.nats_connect_timeout_s
        return await cls.connect(settings.nats_url, name, retry_for_s=retry_for_s,
                                 inbox_prefix=settings.nats_inbox_prefix,
                                 tls=nats_tls(settings))

    @classmethod
    async def connect(cls, url: str, name: str, *, retry_for_s: float = 60.0,
                      inbox_prefix: str = "_INBOX", tls: ssl.SSLContext | None = None) -> Bus:
        """Connects, retrying while the server is not up yet (services may start first);
        BusError with the last failure after `retry_for_s`. Replies (to requests, JetStream
        calls, consumers) arrive on `inbox_prefix`.*."""
        client = nats.NATS()
        try:
            # NOTE: with reconnects on, nats-py retries a failing first connect forever: the
            # deadline is ours.
            await asyncio.wait_for(client.connect(
                server_urls(url), name=name, inbox_prefix=inbox_prefix, tls=tls, allow_reconnect=True,
                max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2,
                ping_interval=5, max_outstanding_pings=2, error_cb=_on_error,
                disconnected_cb=_on_disconnected, reconnected_cb=_on_reconnected),
                timeout=retry_for_s)
        except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
            reason = client.last_error or exc
            with contextlib.suppress(Exception):
                await client.close()
            raise BusError(f"cannot reach NATS at {_safe_url(url)} within {retry_for_s:.0f} s: "
                           f"{str(reason) or type(reason).__name__}; start nats-server, or "
                           f"check --nats-url, its credentials and the --nats-tls-* files"
                           ) from exc
        return cls(client)

    @property
    def is_connected(self) -> bool:
        return self.client.is_connected

    @property
    def reconnects(self) -> int:
        """How often the connection was re-established: messages published or due while it
        was down may be lost, so work that spans a reconnect is re-synchronised."""
        return self.client.stats["reconnects"]

    async def publish(self, subject: str, message: Message) -> None:
        await self.client.publish(subject, encode(message))

    async def request(self, subject: str, message: Message, reply_type: type[R],
                      timeout: float) -> R:
        try:
            reply = await self.client.request(subject, encode(message), timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise NoResponders(f"no service answers on {subject}") from exc
        except nats.errors.TimeoutError as exc:
            raise RequestTimeout(f"no reply on {subject} within {timeout:.1f} s") from exc
        return decode(reply_type, reply.data)

    async def subscribe(self, subject: str, message_type: type[M],
                        handler: Callable[[M], Awaitable[None]], queue: str = "") -> Subscription:
        async def on_message(msg: Msg) -> None:
            try:
                await handler(decode(message_type, msg.data))
            except Exception:
                log.exception("message handler failed", subject=subject)

        return await self.client.subscribe(subject, queue=queue, cb=on_message)

    async def serve(self, subject: str, request_type: type[M],
                    handler: Callable[[M], Awaitable[Message]],
                    queue: str = "", *, concurrent: bool = False) -> Subscription:
        """Answers requests on `subject` with the handler's reply message, one request at a
        time; `concurrent`: each in its own task, so a handler that waits (on a download)
        holds up no other request."""
        async def answer(msg: Msg) -> None:
            try:
                reply = await handler(decode(request_type, msg.data))
            except Exception:
                log.exception("request handler failed", subject=subject)
                return  # the requester times out; every handler answers its own errors
            if msg.reply:
                await msg.respond(encode(reply))

        if not concurrent:
            return await self.client.subscribe(subject, queue=queue, cb=answer)
        in_flight: set[asyncio.Task[None]] = set()   # NOTE: owned, so none is collected

        async def start_answer(msg: Msg) -> None:
            task = asyncio.create_task(answer(msg), name=f"answer {subject}")
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

        return await self.client.subscribe(subject, queue=queue, cb=start_answer)

    async def flush(self, timeout: float = 2.0) -> None:
        await self.client.flush(timeout=timeout)

    async def close(self) -> None:
        if self.client.is_closed:
            return
        try:
            await self.client.drain()
        except (nats.errors.Error, asyncio.TimeoutError, RuntimeError, OSError):
            # The server is already gone (stopped first at shutdown): nothing to flush.
            try:
                await self.client.close()
            except (nats.errors.Error, RuntimeError, OSError) as exc:
                log.debug("NATS connection closed uncleanly", error=str(exc))


def server_urls(url: str) -> list[str]:
    """The servers of a --nats-url: one URL, or a comma-separated list (the nodes of a
    cluster; the client fails over between them, and learns the rest from the cluster)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise BusError("--nats-url is empty")
    return urls


def _safe_url(url: str) -> str:
    return ",".join(u.split("@", 1)[1] if "@" in u else u for u in url.split(","))


async def _on_error(exc: Exception) -> None:
    log.warning("NATS error", error=str(exc) or type(exc).__name__)


async def _on_disconnected() -> None:
    log.warning("NATS disconnected; reconnecting")


async def _on_reconnected() -> None:
    log.info("NATS reconnected")


def nats_tls(settings: CommonSettings) -> ssl.SSLContext | None:
    """TLS to NATS when the settings ask for it (a CA file, a client certificate or a tls://
    URL): verifies the server against the CA file (else the system's CAs) and presents the
    client certificate if one is given."""
    if not (settings.nats_tls_ca_file or settings.nats_tls_cert_file
            or any(u.startswith("tls://") for u in server_urls(settings.nats_url))):
        return None
    try:
        return tls_context(
            ssl.Purpose.SERVER_AUTH, settings.nats_tls_ca_file, settings.nats_tls_cert_file,
            settings.nats_tls_key_file, "--nats-tls-ca-file, --nats-tls-cert-file and "
            "--nats-tls-key-file")
    except ValueError as exc:
        raise BusError(f"cannot set up TLS to NATS: {exc}") from exc
