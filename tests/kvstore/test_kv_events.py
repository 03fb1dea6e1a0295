"""KV events on a real JetStream (an embedded nats-server): a subscriber that starts late
replays the stream, and one that sees a gap in a publisher's sequence resyncs from the
publisher's snapshot and ends with exactly the publisher's blocks."""

from __future__ import annotations

from collections.abc import AsyncIterator

import betterproto
import pytest

from llm_mesh.embedded import EmbeddedNats
from services.common import wire
from services.common.bus import Bus
from services.common.kv_event_stream import KVEventPublisher
from services.common.subjects import Subjects
from services.frontend.router.kv_event_subscriber import KVEventSubscriber
from tests.waiting import until

SUBJECTS = Subjects("kvevents")


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    with EmbeddedNats() as nats:
        connected = await Bus.connect(nats.url, name="kv-events-test")
        yield connected
        await connected.close()


def stored(*hashes: bytes) -> wire.KvEvent:
    return wire.KvEvent(stored=wire.BlockStored(block_hashes=list(hashes)))


def removed(*hashes: bytes) -> wire.KvEvent:
    return wire.KvEvent(removed=wire.BlockRemoved(block_hashes=list(hashes)))


async def test_a_late_subscriber_replays_and_a_gap_resyncs_from_the_snapshot(bus: Bus) -> None:
    held: set[bytes] = set()        # the publisher's true state, which its snapshot reports
    publisher = KVEventPublisher(bus, SUBJECTS, "engine-a",
                                 snapshot=lambda: [stored(*sorted(held))])
    await publisher.start()

    def publish(*events: wire.KvEvent) -> None:
        for event in events:
            kind, payload = betterproto.which_one_of(event, "event")
            (held.update if kind == "stored" else held.difference_update)(payload.block_hashes)
        publisher.publish(list(events))

    publish(stored(b"a", b"b"))
    publish(stored(b"c"), removed(b"a"))
    subscriber = KVEventSubscriber(bus, SUBJECTS)
    await subscriber.start()        # after two batches: it replays them from the stream
    await until(lambda: subscriber.last_seq.get("engine-a") == 2)
    assert subscriber.index.blocks_of("engine-a") == {b"b", b"c"} and subscriber.num_resyncs == 0

    # A batch lost on the way (NATS restarting, say): the publisher's state moves on, the
    # stream never carries it; the next batch shows the gap.
    held.add(b"lost")
    publisher.seq += 1
    publish(stored(b"d"))
    await until(lambda: subscriber.last_seq.get("engine-a") == 4)
    assert subscriber.num_resyncs == 1
    assert subscriber.index.blocks_of("engine-a") == held == {b"b", b"c", b"d", b"lost"}
    await publisher.close()
