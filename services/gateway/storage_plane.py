"""A store in JetStream that a gateway connects to on first use, over a NATS connection of
its own: a storage plane apart from the request path, so a gateway that never serves a
batch or a stored response never touches JetStream."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from services.common.bus import Bus, BusError
from services.common.jetstream import retry_transient
from services.common.subjects import Subjects
from services.frontend.errors import unavailable
from services.frontend.settings import FrontendSettings

S = TypeVar("S")
OPEN_RETRY_S = 10.0   # how long the first use waits out a JetStream failover
Opener = Callable[[JetStreamContext, Subjects, int], Awaitable[S]]


class StoragePlane(Generic[S]):
    def __init__(self, settings: FrontendSettings, connection_name: str, open_store: Opener[S],
                 what: str) -> None:
        self._settings = settings
        self._connection_name = connection_name
        self._open_store = open_store
        self._what = what                # "batch", "responses": in the 503's words and code
        self._store: S | None = None
        self.nats: Client | None = None  # the plane's connection, once open
        self._lock = asyncio.Lock()

    async def store(self) -> S:
        """The store, connected on first use; 503 when JetStream cannot be reached."""
        async with self._lock:
            if self._store is None:
                bus: Bus | None = None
                try:
                    bus = await Bus.for_settings(self._settings, self._connection_name,
                                                 retry_for_s=5.0)
                    js, subjects = bus.client.jetstream(), Subjects(self._settings.namespace)
                    # Binding or creating the buckets is idempotent: a stream electing a
                    # leader (a NATS node lost or just back) is waited out.
                    self._store = await retry_transient(
                        lambda: self._open_store(js, subjects,
                                                 self._settings.jetstream_replicas),
                        OPEN_RETRY_S)
                    self.nats = bus.client
                except (BusError, nats.errors.Error) as exc:
                    if bus is not None:
                        await bus.close()
                    raise unavailable(f"the {self._what} store is not reachable: {exc}",
                                      code=f"{self._what}_store_unavailable") from exc
        return self._store
