"""The gateway's storage plane opens its store on first use, against a real nats-server:
a JetStream call timing out (a stream electing a leader) is waited out, anything else is
a 503 that leaves no connection behind."""

from __future__ import annotations

import itertools

import nats.errors
import pytest
from nats.js import JetStreamContext

from llm_mesh.embedded import EmbeddedNats
from services.common.bus import Bus
from services.common.subjects import Subjects
from services.frontend.batch_jobs.batch_store import BatchStore
from services.frontend.errors import ApiError
from services.gateway.settings import GatewaySettings
from services.gateway.storage_plane import StoragePlane

_namespaces = itertools.count()


def settings(nats_server: EmbeddedNats) -> GatewaySettings:
    return GatewaySettings(nats_url=nats_server.url, namespace=f"plane{next(_namespaces)}")


async def test_the_first_use_waits_out_a_jetstream_timeout(nats_server: EmbeddedNats) -> None:
    attempts: list[int] = []

    async def open_after_a_failover(js: JetStreamContext, subjects: Subjects,
                                    replicas: int) -> BatchStore:
        attempts.append(replicas)
        if len(attempts) == 1:
            raise nats.errors.TimeoutError   # what a stream without a leader answers
        return await BatchStore.open(js, subjects, replicas)

    plane = StoragePlane(settings(nats_server), "plane-test", open_after_a_failover, "batch")
    store = await plane.store()
    assert isinstance(store, BatchStore) and len(attempts) == 2
    assert await plane.store() is store   # opened once
    assert plane.nats is not None
    await plane.nats.close()


async def test_a_store_that_cannot_open_is_a_503_without_a_leftover_connection(
        nats_server: EmbeddedNats, buses: list[Bus]) -> None:
    async def refuse(js: JetStreamContext, subjects: Subjects, replicas: int) -> BatchStore:
        raise nats.errors.NoServersError   # not a failover: no point waiting

    plane = StoragePlane(settings(nats_server), "plane-test", refuse, "batch")
    with pytest.raises(ApiError) as raised:
        await plane.store()
    assert raised.value.status == 503 and "batch store is not reachable" in str(
        raised.value)
    assert plane.nats is None and len(buses) == 1 and buses[0].client.is_closed
