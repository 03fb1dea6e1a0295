"""Packed arrays and string lists for `bytes` fields on the wire.

Numbers are little-endian int32 / float32 / uint8. A StringList is
[int32 count][int32 byte length per item][utf-8 items, concatenated]; it replaces
`repeated string` in per-step messages, which betterproto parses at ~5 us per item.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

INT32 = np.dtype("<i4")
FLOAT32 = np.dtype("<f4")
UINT8 = np.dtype("u1")


def pack_int32(values: Iterable[int] | np.ndarray) -> bytes:
    return np.asarray(values if not isinstance(values, range) else list(values),
                      dtype=INT32).tobytes()


def unpack_int32(data: bytes) -> np.ndarray:
    """A read-only int32 view of `data` (copy it before writing)."""
    return np.frombuffer(data, dtype=INT32)


def pack_float32(values: Iterable[float] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=FLOAT32).tobytes()


def unpack_float32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=FLOAT32)


def pack_uint8(values: Iterable[int] | np.ndarray) -> bytes:
    return np.asarray(values, dtype=UINT8).tobytes()


def unpack_uint8(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=UINT8)


def pack_strings(items: Sequence[str]) -> bytes:
    encoded = [s.encode("utf-8", "surrogatepass") for s in items]
    lengths = np.fromiter((len(e) for e in encoded), dtype=INT32, count=len(encoded))
    return np.int32(len(encoded)).astype(INT32).tobytes() + lengths.tobytes() + b"".join(encoded)


def unpack_strings(data: bytes) -> list[str]:
    if not data:
        return []
    count = int(np.frombuffer(data, dtype=INT32, count=1)[0])
    lengths = np.frombuffer(data, dtype=INT32, count=count, offset=4)
    ends = (np.cumsum(lengths, dtype=np.int64) + 4 + 4 * count).tolist()
    starts = [4 + 4 * count, *ends[:-1]]
    return [data[s:e].decode("utf-8", "surrogatepass") for s, e in zip(starts, ends)]
