"""The router's side of the KV events stream (services/common/kv_event_stream.py): a
subscriber that mirrors which blocks each publisher holds into a PrefixIndex, replays the
stream's window on start, notices gaps and resyncs (Dynamo's subscribe -> snapshot -> replay).

Publishers stamp every KVEventBatch with their id and a sequence number that grows by one per
batch; when the first batch seen from a publisher is not seq 1, or a number is skipped (a
publish lost while NATS restarted, a batch aged out), the subscriber asks the publisher for a
snapshot and continues after the snapshot's seq.
"""

from __future__ import annotations

import time

import structlog
from nats.aio.msg import Msg
from nats.js import api

from services.common import wire
from services.common.bus import Bus, BusError
from services.common.kv_event_stream import ensure_stream
from services.common.subjects import Subjects
from services.frontend.router.prefix_index import PrefixIndex

log = structlog.get_logger(__name__)


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
