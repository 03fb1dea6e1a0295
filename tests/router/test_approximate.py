"""ApproximateIndex: overlaps predicted from routing decisions, forgotten after a TTL."""

from __future__ import annotations

from services.common.block_hash import BlockHasher
from services.frontend.router import ApproximateIndex

CHAIN = BlockHasher(block_size=4).hash_blocks(list(range(40)))


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_decision_predicts_the_prompt_blocks() -> None:
    index = ApproximateIndex(ttl_s=10, clock=Clock())
    index.record("a", CHAIN[:6])
    index.record("b", CHAIN[:2])
    assert index.overlaps(CHAIN) == {"a": 6, "b": 2}
    assert index.num_blocks == 6


def test_entries_expire_after_the_ttl() -> None:
    clock = Clock()
    index = ApproximateIndex(ttl_s=10, clock=clock)
    index.record("a", CHAIN[:6])
    clock.now += 5
    index.record("b", CHAIN[:3])
    clock.now += 4.9
    assert index.overlaps(CHAIN) == {"a": 6, "b": 3}
    clock.now += 0.1   # a's entry is due
    assert index.overlaps(CHAIN) == {"b": 3}
    clock.now += 5
    assert index.overlaps(CHAIN) == {}
    assert index.num_blocks == 0


def test_recording_again_renews_the_blocks() -> None:
    clock = Clock()
    index = ApproximateIndex(ttl_s=10, clock=clock)
    index.record("a", CHAIN[:4])
    clock.now += 8
    index.record("a", CHAIN[:8])   # the next turn of the conversation, on the same engine
    clock.now += 8                 # the first record is due; its blocks were renewed
    assert index.overlaps(CHAIN) == {"a": 8}
    clock.now += 2
    assert index.overlaps(CHAIN) == {}


def test_removed_worker_is_forgotten_and_can_return() -> None:
    clock = Clock()
    index = ApproximateIndex(ttl_s=10, clock=clock)
    index.record("a", CHAIN[:4])
    index.remove_worker("a")
    assert index.overlaps(CHAIN) == {}
    clock.now += 5
    index.record("a", CHAIN[:2])
    clock.now += 5   # the entry from before the removal falls due: it must not drop these
    assert index.overlaps(CHAIN) == {"a": 2}
