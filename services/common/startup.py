"""Where a service's start-up time goes: the phases it went through, said once in its
`ready` log line, so a slow restart names its slow step (imports, the NATS connection,
model load, KV sizing) instead of leaving operators to guess."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager


def process_age_s() -> float:
    """Seconds since this process was exec'd (the interpreter's own start and the imports
    count too: they are most of a Python service's start-up)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return max(0.0, uptime_s - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0   # not Linux: the ready line then omits nothing but this figure


class StartupPhases:
    """Named, timed phases of a start-up, in the order they ran."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def as_log(self) -> dict[str, float]:
        return {name: round(s, 2) for name, s in self.seconds.items()}
