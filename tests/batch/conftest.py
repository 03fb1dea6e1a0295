"""Batch fixtures: a nats-server with JetStream, and a batch store on a fresh namespace per
test (so tests never see each other's jobs)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterator

import nats
import pytest

from llm_mesh.embedded import EmbeddedNats
from services.common.batch_jobs.store import BatchStore
from services.common.subjects import Subjects

_namespaces = itertools.count()


@pytest.fixture(scope="module")
def nats_server() -> Iterator[EmbeddedNats]:
    server = EmbeddedNats().start()
    yield server
    server.stop()


@pytest.fixture
async def store(nats_server: EmbeddedNats) -> AsyncIterator[BatchStore]:
    client = await nats.connect(nats_server.url)
    yield await BatchStore.open(client.jetstream(), Subjects(f"t{next(_namespaces)}"))
    await client.close()
