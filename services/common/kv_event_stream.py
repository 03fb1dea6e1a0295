"""KV cache events on JetStream: a publisher with sequence numbers, and a subscriber that
replays, notices gaps and resyncs (Dynamo's subscribe -> snapshot -> replay).

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
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api

from services.common import wire
from services.common.bus import Bus, BusError
from services.common.jetstream import ensure_window_stream
from services.common.router import PrefixIndex
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


class KVEventSubscriber:
    """Mirrors which blocks each publisher holds into a PrefixIndex (publisher id -> blocks),
    replaying the stream's window on start."""

    def __init__(self, bus: Bus, subjects: Subjects, snapshot_timeout_s: float = 2.0,
                 index: PrefixIndex | None = None, replicas: int = 1) -> None:
        self._bus = bus
        self._subjects = subjects
        self._replicas = replicas   # of the stream, if this subscriber creates it
        self._snapshot_timeout_s = snapshot_timeout_s
        self.index = index if index is not None else PrefixIndex()
        self.last_seq: dict[str, int] = {}
        self.num_resyncs = 0
        self.lag_s = 0.0      # how old the last batch applied was when it arrived

    async def start(self) -> None:
        js = self._bus.client.jetstream()
        await ensure_stream(js, self._subjects, self._replicas)
        # Subscribe first, then resync on the first batch of each publisher: nothing published
        # between the snapshot and the subscription can be missed.
        await js.subscribe(self._subjects.kv_events_all, cb=self._on_msg, ordered_consumer=True,
                           deliver_policy=api.DeliverPolicy.ALL)

    def forget(self, publisher: str) -> None:
        """The publisher left the mesh: its blocks are gone with it."""
        self.index.remove_worker(publisher)
        self.last_seq.pop(publisher, None)

    async def _on_msg(self, msg: Msg) -> None:
        try:
            await self.on_batch(wire.KvEventBatch().parse(msg.data))
        except Exception:
            log.exception("KV event batch not applied")

    async def on_batch(self, batch: wire.KvEventBatch) -> None:
        publisher = batch.publisher_id
        last = self.last_seq.get(publisher, 0)
        if batch.seq <= last:
            return   # already covered by a snapshot
        if batch.seq != last + 1:
            # A gap, or a late start: the snapshot covers every batch up to its seq.
            if not await self.resync(publisher):
                self.index.clear_worker(publisher)   # publisher gone: hold nothing of it
            elif batch.seq <= self.last_seq[publisher]:
                return
        self.index.apply(publisher, batch.events)
        self.last_seq[publisher] = batch.seq
        self.lag_s = max(0.0, time.time() - batch.time)

    async def resync(self, publisher: str) -> bool:
        """Replaces the publisher's state with its snapshot; False if it did not answer."""
        self.num_resyncs += 1
        try:
            snapshot = await self._bus.request(self._subjects.kv_snapshot(publisher),
                                               wire.KvSnapshotRequest(), wire.KvEventBatch,
                                               timeout=self._snapshot_timeout_s)
        except BusError as exc:
            log.info("KV event publisher did not answer a resync", publisher=publisher,
                     error=str(exc))
            return False
        self.index.clear_worker(publisher)
        self.index.apply(publisher, snapshot.events)
        self.last_seq[publisher] = snapshot.seq
        return True
