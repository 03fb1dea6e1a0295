"""Free ports for servers started a moment later (embedded NATS and Redis, every service's
health port under `llm-mesh up`, a tensor-parallel group's rendezvous, the tests' servers),
from outside the kernel's ephemeral range."""

from __future__ import annotations

import contextlib
import random
import socket
from collections.abc import Iterable
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


_LOWEST_PORT = 10_240    # above the well-known and registered ports most servers use
# Ports handed out by this process, so two callers never get the same one before binding it.
_handed_out: set[int] = set()


def reserve_ports(ports: Iterable[int]) -> None:
    """Ports configured for servers not bound yet (`llm-mesh up --port`): free_ports must not
    hand them to another server first (CI once saw the gateway's port drawn for NATS)."""
    _handed_out.update(port for port in ports if port > 0)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free now, for servers started a moment later. They come from
    outside the kernel's ephemeral range: a port the OS picked with bind(0) can be taken by
    any outgoing connection before our server binds it (a worker's health port once lost
    that race in CI)."""
    low, high = _ephemeral_range()
    num_below = max(0, low - _LOWEST_PORT)       # candidates below the range, then above it
    num_candidates = num_below + max(0, 65_535 - high)
    chosen: list[int] = []
    with contextlib.ExitStack() as stack:
        for _ in range(10_000 if num_candidates else 0):
            k = random.randrange(num_candidates)
            port = _LOWEST_PORT + k if k < num_below else high + 1 + k - num_below
            if port in _handed_out or port in chosen:
                continue
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind((host, port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                _handed_out.update(chosen)
                return chosen
    raise RuntimeError(f"no {count} free ports on {host} outside the ephemeral range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999       # Linux's default; other systems use 49152-65535
