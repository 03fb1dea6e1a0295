from services.common.block_hash import BlockHasher, HashAlgo, MultiModalSpan


def test_only_full_blocks_are_hashed() -> None:
    hasher = BlockHasher(block_size=4)
    assert len(hasher.hash_blocks(list(range(11)))) == 2


def test_hash_chains_through_the_parent() -> None:
    hasher = BlockHasher(block_size=4)
    a = hasher.hash_blocks([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hash_blocks([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_extend_matches_hashing_at_once() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(20))
    grown: list[bytes] = []
    for end in range(1, 21):
        hasher.extend(grown, tokens[:end])
    assert grown == hasher.hash_blocks(tokens)


def test_cache_salt_changes_every_block_and_lora_too() -> None:
    hasher = BlockHasher(block_size=4)
    tokens = list(range(8))
    plain = hasher.hash_blocks(tokens)
    salted = hasher.hash_blocks(tokens, cache_salt="tenant-a")
    other = hasher.hash_blocks(tokens, cache_salt="tenant-b")
    assert len({plain[0], salted[0], other[0]}) == 3
    assert plain[1] != salted[1]  # through the parent chain
    assert hasher.hash_blocks(tokens, lora_id=3) != plain


def test_hashes_agree_across_instances_and_depend_on_seed_and_algo() -> None:
    tokens = list(range(32))
    assert BlockHasher(16).hash_blocks(tokens) == BlockHasher(16).hash_blocks(tokens)
    assert BlockHasher(16, seed="x").hash_blocks(tokens) != BlockHasher(16).hash_blocks(tokens)
    fast = BlockHasher(16, HashAlgo.XXH3_128).hash_blocks(tokens)
    assert fast != BlockHasher(16).hash_blocks(tokens) and len(fast[0]) == 16


def test_an_images_hash_enters_exactly_the_blocks_of_its_placeholders() -> None:
    """Same image, same blocks; another image at the same placeholders changes the blocks
    holding them (and every block after: the chain), never the blocks before."""
    hasher = BlockHasher(block_size=4)
    tokens = list(range(100, 120))                        # 5 blocks; placeholders 6..13
    cat, dog = MultiModalSpan(6, 8, "a" * 64), MultiModalSpan(6, 8, "b" * 64)
    with_cat = hasher.hash_blocks(tokens, mm_spans=(cat,))
    assert with_cat == hasher.hash_blocks(tokens, mm_spans=(cat,))
    with_dog = hasher.hash_blocks(tokens, mm_spans=(dog,))
    assert with_cat[0] == with_dog[0] == hasher.hash_blocks(tokens)[0]
    assert all(a != b for a, b in zip(with_cat[1:], with_dog[1:]))
    assert [bool(hasher.extra_keys(i, mm_spans=(cat,))) for i in range(5)] == \
        [False, True, True, True, False]
