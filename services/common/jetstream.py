"""Creating the JetStream streams and KV buckets the mesh keeps (whoever comes first creates
one, and creating what exists is a no-op), and telling a transient JetStream failure from a
real one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors as js_errors
from nats.js import JetStreamContext, api
from nats.js.kv import KeyValue

T = TypeVar("T")


async def ensure_window_stream(js: JetStreamContext, name: str, subjects: list[str],
                               max_age_s: float, max_bytes: int, replicas: int = 1) -> None:
    """A stream that keeps a bounded window (the oldest messages go first), file-backed so
    the window survives a NATS restart on its store directory (docs/operations.md), on
    `replicas` nodes of a cluster (--jetstream-replicas)."""
    try:
        await js.stream_info(name)
    except js_errors.NotFoundError:
        await js.add_stream(api.StreamConfig(
            name=name, subjects=subjects, max_age=max_age_s, max_bytes=max_bytes,
            discard=api.DiscardPolicy.OLD, storage=api.StorageType.FILE,
            num_replicas=replicas))


async def ensure_key_value(js: JetStreamContext, bucket: str, ttl_s: float | None,
                           replicas: int = 1) -> KeyValue:
    """A KV bucket keeping each key's latest value (for `ttl_s`, None: for ever)."""
    try:
        return await js.key_value(bucket)
    except js_errors.BucketNotFoundError:
        return await js.create_key_value(bucket=bucket, history=1, ttl=ttl_s,
                                         replicas=replicas)


class EntryNotReadableError(nats.errors.Error):
    """A KV key exists but its entry cannot be read back yet: a failover in progress."""


# What NATS raises while a node is down or a JetStream stream elects a new leader (the
# replicas answer 500 "not leader" / "stream offline" and 503 until one is elected; a
# publish meets no responders while a rejoined node learns where the stream is): the same
# call may succeed moments later.
_TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
              nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
              js_errors.ServiceUnavailableError, js_errors.ServerError,
              js_errors.NoStreamResponseError, EntryNotReadableError)


def is_transient(exc: BaseException) -> bool:
    """True for a NATS or JetStream failure that a retry shortly after may not meet."""
    return isinstance(exc, _TRANSIENT) or (
        type(exc) is js_errors.APIError and exc.code in (408, 500, 503))


async def retry_transient(operation: Callable[[], Awaitable[T]], within_s: float) -> T:
    """`operation()`, called again on transient failures until `within_s` have passed (the
    last failure is raised). Only for idempotent operations."""
    deadline = time.monotonic() + within_s
    pause_s = 0.1
    while True:
        try:
            return await operation()
        except nats.errors.Error as exc:
            if not is_transient(exc) or time.monotonic() + pause_s > deadline:
                raise
        await asyncio.sleep(pause_s)
        pause_s = min(pause_s * 2, 1.0)
