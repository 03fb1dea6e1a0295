"""Which engine each conversation runs on, and how much history each engine holds for them.

A session (the `prompt_cache_key` body field, or an `x-session-id` header) is bound to the
engine its last turn went to, with that turn's prompt size: the history the engine holds for
it and that its next turn will want back. The router places a *new* session on an engine
serving the fewest live sessions for its KV, then by the sum of their histories and its load,
so conversations split by what they will need, not by which engine was idle the moment each
began (measured: five of eight agents on one engine of two, which then recomputed evicted
histories while the other idled).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

MAX_SESSIONS = 100_000


@dataclass(slots=True)
class _Session:
    engine_id: str
    seen_at: float
    num_blocks: int
    probe: bytes   # the hash of the middle block of its last prompt (b"": none)


class SessionTable:
    """Session id -> the engine it last ran on; least recently used dropped past a bound,
    entries older than the TTL forgotten."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_entries: int = MAX_SESSIONS) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._max_entries = max_entries
        self._entries: OrderedDict[str, _Session] = OrderedDict()   # least recent first
        self._blocks_on: dict[str, int] = {}   # engine id -> its live sessions' blocks
        self._sessions_on: dict[str, int] = {}   # engine id -> its live sessions

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> str | None:
        entry = self._entries.get(session_id)
        if entry is None or self._clock() - entry.seen_at > self._ttl_s:
            return None
        return entry.engine_id

    def bind(self, session_id: str, engine_id: str, num_blocks: int = 0,
             probe: bytes = b"") -> None:
        """The session's latest turn went to `engine_id` with a prompt of `num_blocks`, the
        middle one of which hashes to `probe`: while the engine holds that block, it holds
        at least half of the history (blocks are evicted tail first)."""
        old = self._entries.pop(session_id, None)
        if old is not None:
            self._count(old, -1)
        entry = self._entries[session_id] = _Session(engine_id, self._clock(), num_blocks,
                                                     probe)
        self._count(entry, 1)
        while len(self._entries) > self._max_entries:
            self._count(self._entries.popitem(last=False)[1], -1)
        self._expire()

    def probe(self, session_id: str) -> bytes:
        """The session's probe block hash (bind); b"" for none or an unknown session."""
        entry = self._entries.get(session_id)
        return entry.probe if entry is not None else b""

    def num_blocks_on(self, engine_id: str) -> int:
        """KV blocks of the live sessions bound to the engine: what they will come back for."""
        self._expire()
        return self._blocks_on.get(engine_id, 0)

    def num_sessions_on(self, engine_id: str) -> int:
        """Live sessions bound to the engine."""
        self._expire()
        return self._sessions_on.get(engine_id, 0)

    def _expire(self) -> None:
        oldest = self._clock() - self._ttl_s
        while self._entries:
            session_id, entry = next(iter(self._entries.items()))
            if entry.seen_at >= oldest:
                return
            del self._entries[session_id]
            self._count(entry, -1)

    def _count(self, entry: _Session, sign: int) -> None:
        _add(self._blocks_on, entry.engine_id, sign * entry.num_blocks)
        _add(self._sessions_on, entry.engine_id, sign)


def _add(counts: dict[str, int], engine_id: str, delta: int) -> None:
    left = counts.get(engine_id, 0) + delta
    if left > 0:
        counts[engine_id] = left
    else:
        counts.pop(engine_id, None)
