"""PrefixIndex: leading-block overlaps per worker, kept up to date by KV events."""

from __future__ import annotations

from services.common import wire
from services.common.block_hash import BlockHasher
from services.frontend.router import PrefixIndex

HASHER = BlockHasher(block_size=4)
CHAIN = HASHER.hash_blocks(list(range(40)))   # 10 chained blocks
OTHER = HASHER.hash_blocks(list(range(100, 140)))


def stored(hashes: list[bytes], medium: wire.KvMedium = wire.KvMedium.GPU) -> wire.KvEvent:
    return wire.KvEvent(stored=wire.BlockStored(block_hashes=hashes, medium=medium))


def removed(hashes: list[bytes], medium: wire.KvMedium = wire.KvMedium.GPU) -> wire.KvEvent:
    return wire.KvEvent(removed=wire.BlockRemoved(block_hashes=hashes, medium=medium))


CLEARED = wire.KvEvent(cleared=wire.AllBlocksCleared())


def test_overlap_counts_leading_blocks_only() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN[:6])])
    index.apply("b", [stored(CHAIN[:3]), stored(CHAIN[4:])])   # a hole at block 3
    index.apply("c", [stored(CHAIN[1:])])                      # lacks the first block
    assert index.overlaps(CHAIN) == {"a": 6, "b": 3}
    assert index.overlaps(CHAIN[:2]) == {"a": 2, "b": 2}
    assert index.overlaps(OTHER) == {}
    assert index.overlaps([]) == {}


def test_removed_block_breaks_the_chain() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN)])
    index.apply("a", [removed([CHAIN[5]])])
    assert index.overlaps(CHAIN) == {"a": 5}
    index.apply("a", [removed([CHAIN[5], OTHER[0]])])   # already gone, never held: no-ops
    assert index.overlaps(CHAIN) == {"a": 5}
    assert index.num_blocks == 9


def test_cleared_drops_only_that_worker() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN)])
    index.apply("b", [stored(CHAIN[:4])])
    index.apply("a", [CLEARED])
    assert index.overlaps(CHAIN) == {"b": 4}
    assert index.num_blocks == 4


def test_snapshot_replaces_state() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN), stored(OTHER[:2])])
    index.apply("a", [CLEARED, stored(OTHER)])   # a resync: what the publisher holds now
    assert index.overlaps(CHAIN) == {}
    assert index.overlaps(OTHER) == {"a": 10}
    assert index.num_blocks == 10


def test_media_are_separate_and_filterable() -> None:
    index = PrefixIndex()
    index.apply("engine", [stored(CHAIN[:3])])
    index.apply("kvstore", [stored(CHAIN[:5], wire.KvMedium.CPU),
                            stored(CHAIN[5:8], wire.KvMedium.DISK)])
    assert index.overlaps(CHAIN) == {"engine": 3}   # by default: engines' own pools
    assert index.overlaps(CHAIN, media=[wire.KvMedium.CPU]) == {"kvstore": 5}
    assert index.overlaps(CHAIN, media=[wire.KvMedium.CPU, wire.KvMedium.DISK]) == {
        "kvstore": 8}
    # A block moving down a tier: stored on disk, removed from memory.
    index.apply("kvstore", [stored(CHAIN[:2], wire.KvMedium.DISK),
                            removed(CHAIN[:2], wire.KvMedium.CPU)])
    assert index.overlaps(CHAIN, media=[wire.KvMedium.CPU]) == {}
    assert index.overlaps(CHAIN, media=[wire.KvMedium.CPU, wire.KvMedium.DISK]) == {
        "kvstore": 8}


def test_unspecified_medium_is_the_engine_pool() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN[:2], wire.KvMedium.UNSPECIFIED)])
    assert index.overlaps(CHAIN) == {"a": 2}


def test_removed_worker_frees_its_slot_for_a_new_one() -> None:
    index = PrefixIndex()
    index.apply("a", [stored(CHAIN)])
    index.apply("b", [stored(CHAIN[:2])])
    index.remove_worker("a")
    index.remove_worker("a")   # twice: harmless
    assert index.overlaps(CHAIN) == {"b": 2}
    index.apply("c", [stored(CHAIN[:7])])   # takes a's slot; a's blocks must not show up
    assert index.overlaps(CHAIN) == {"b": 2, "c": 7}
    assert index.num_blocks == 7


def test_events_from_the_wire() -> None:
    batch = wire.KvEventBatch(publisher_id="a", seq=1, events=[stored(CHAIN), removed(CHAIN[8:])])
    parsed = wire.KvEventBatch().parse(bytes(batch))
    index = PrefixIndex()
    index.apply(parsed.publisher_id, parsed.events)
    assert index.overlaps([bytes(h) for h in CHAIN]) == {"a": 8}
