"""Prefix-cache block hashes: the one definition every service uses.

A full block's hash is H(parent hash, its token ids as int32 bytes, extra keys). The
first block's parent is H(seed); `cache_salt` is mixed into the first block only, so
requests with different salts never share a prefix; a LoRA id goes into every block; the
content hash of each image whose placeholder tokens a block holds goes into that block, so
two prompts with the same image share blocks and two different images never do.
Only canonical bytes are hashed (never pickled objects), so the tokenizer, scheduler,
router and kvstore compute the same hashes bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from enum import Enum
from typing import NamedTuple

import numpy as np
import xxhash

BlockHash = bytes


class MultiModalSpan(NamedTuple):
    """An image's placeholder tokens in a prompt: [offset, offset + length)."""
    offset: int
    length: int
    content_hash: str


class HashAlgo(str, Enum):
    SHA256 = "sha256"        # collision-safe default
    XXH3_128 = "xxh3_128"    # fast, non-cryptographic


_HASH_FUNCTIONS: dict[HashAlgo, Callable[[bytes], bytes]] = {
    HashAlgo.SHA256: lambda data: hashlib.sha256(data).digest(),
    HashAlgo.XXH3_128: lambda data: xxhash.xxh3_128_digest(data),
}


class BlockHasher:
    def __init__(self, block_size: int, algo: HashAlgo | str = HashAlgo.SHA256,
                 seed: str = "llm-mesh") -> None:
        self.block_size = block_size
        self.algo = HashAlgo(algo)
        self._hash = _HASH_FUNCTIONS[self.algo]
        self.root_hash: BlockHash = self._hash(b"root:" + seed.encode())

    def extra_keys(self, block_index: int, cache_salt: str = "", lora_id: int = 0,
                   mm_spans: Sequence[MultiModalSpan] = ()) -> bytes:
        keys = b""
        if block_index == 0 and cache_salt:
            keys += b"salt:" + cache_salt.encode()
        if lora_id:
            keys += b"lora:" + str(lora_id).encode()
        if mm_spans:
            start = block_index * self.block_size
            end = start + self.block_size
            for span in mm_spans:
                if span.offset < end and start < span.offset + span.length:
                    keys += b"mm:" + span.content_hash.encode()
        return keys

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int] | np.ndarray,
                   extra_keys: bytes = b"") -> BlockHash:
        tokens = np.asarray(token_ids, dtype="<i4").tobytes()
        return self._hash(parent + len(tokens).to_bytes(4, "little") + tokens + extra_keys)

    def extend(self, hashes: list[BlockHash], token_ids: Sequence[int] | np.ndarray,
               cache_salt: str = "", lora_id: int = 0,
               mm_spans: Sequence[MultiModalSpan] = ()) -> list[BlockHash]:
        """Appends the hashes of the full blocks of `token_ids` not yet in `hashes`."""
        size = self.block_size
        tokens = np.asarray(token_ids, dtype="<i4")
        parent = hashes[-1] if hashes else self.root_hash
        for index in range(len(hashes), len(tokens) // size):
            parent = self.hash_block(parent, tokens[index * size:(index + 1) * size],
                                     self.extra_keys(index, cache_salt, lora_id, mm_spans))
            hashes.append(parent)
        return hashes

    def hash_blocks(self, token_ids: Sequence[int] | np.ndarray, cache_salt: str = "",
                    lora_id: int = 0,
                    mm_spans: Sequence[MultiModalSpan] = ()) -> list[BlockHash]:
        return self.extend([], token_ids, cache_salt, lora_id, mm_spans)
