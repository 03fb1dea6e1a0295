"""KV cache events on JetStream: the stream, and a publisher with sequence numbers (the
subscriber that replays, notices gaps and resyncs, Dynamo's subscribe -> snapshot -> replay,
is the router's: services/frontend/router/kv_event_subscriber.py).

Publishers (an engine's scheduler, a kvstore node) stamp every KVEventBatch with their id and
a sequence number that grows by one per batch, and answer snapshot requests with their whole
state. The stream keeps a bounded window (age, bytes), so a subscriber that starts late
replays what is left; when the first batch it sees from a publisher is not seq 1, or a
number is skipped (a publish lost while NATS restarted, a batch aged out), it asks the
publisher for a snapshot and continues after the snapshot's seq.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from nats.js import JetStreamContext

from services.common import wire
from services.common.bus import Bus
from services.common.jetstream import ensure_window_stream
from services.common.subjects import Subjects

log = structlog.get_logger(__name__)

STREAM_MAX_AGE_S = 600.0
STREAM_MAX_BYTES = 64 * 1024 * 1024
_MAX_QUEUED_BATCHES = 10_000


async def ensure_stream(js: JetStreamContext, subjects: Subjects, replicas: int = 1) -> None:
    """Creates the bounded events stream if missing (whoever comes first)."""
    await ensure_window_stream(js, subjects.kv_events_stream, [subjects.kv_events_all],
                               STREAM_MAX_AGE_S, STREAM_MAX_BYTES, replicas)


class KVEventPublisher:
    """Publishes batches in order from a background task, so a step never waits on JetStream.
    A batch that cannot be published is dropped: subscribers see the gap and resync."""

    def __init__(self, bus: Bus, subjects: Subjects, publisher_id: str,
                 snapshot: Callable[[], list[wire.KvEvent]], fingerprint: str = "",
                 replicas: int = 1) -> None:
        self._bus = bus
        self._subjects = subjects
        self._replicas = replicas   # of the stream, if this publisher creates it
        self.publisher_id = publisher_id
        self.fingerprint = fingerprint
        self._snapshot = snapshot
        self.seq = 0
        self._queue: asyncio.Queue[wire.KvEventBatch] = asyncio.Queue(_MAX_QUEUED_BATCHES)
        self._sender: asyncio.Task[None] | None = None

    async def start(self) -> None:
        js = self._bus.client.jetstream()
        await ensure_stream(js, self._subjects, self._replicas)
        await self._bus.serve(self._subjects.kv_snapshot(self.publisher_id),
                              wire.KvSnapshotRequest, self._on_snapshot)
        self._sender = asyncio.create_task(self._send_loop(js))

    def publish(self, events: list[wire.KvEvent]) -> None:
        if not events:
            return
        self.seq += 1
        batch = wire.KvEventBatch(publisher_id=self.publisher_id, seq=self.seq, time=time.time(),
                                  fingerprint=self.fingerprint, events=events)
        try:
            self._queue.put_nowait(batch)
        except asyncio.QueueFull:
            log.warning("KV event queue full; dropping a batch", seq=self.seq)

    async def close(self) -> None:
        if self._sender is not None:
            self._sender.cancel()

    async def _send_loop(self, js: JetStreamContext) -> None:
        subject = self._subjects.kv_events(self.publisher_id)
        while True:
            batch = await self._queue.get()
            try:
                await js.publish(subject, bytes(batch), timeout=2.0)
            except Exception as exc:  # NATS down or slow: the gap makes subscribers resync
                log.warning("KV event batch not published", seq=batch.seq, error=str(exc))

    async def _on_snapshot(self, _: wire.KvSnapshotRequest) -> wire.KvEventBatch:
        # NOTE: runs on the loop between steps, so the state matches every batch numbered up
        # to self.seq; batches queued but not yet sent are re-applied, which is harmless.
        events = [wire.KvEvent(cleared=wire.AllBlocksCleared()), *self._snapshot()]
        return wire.KvEventBatch(publisher_id=self.publisher_id, seq=self.seq, time=time.time(),
                                 fingerprint=self.fingerprint, events=events, is_snapshot=True)
