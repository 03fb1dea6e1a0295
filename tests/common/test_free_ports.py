"""Ports for test and embedded servers come from outside the kernel's ephemeral range, so no
outgoing connection can take one between choosing it and the server binding it."""

from __future__ import annotations

import socket

from services.common import ports
from services.common.ports import _ephemeral_range, free_port, free_ports


def test_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = _ephemeral_range()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    for port in ports:
        assert not low <= port <= high
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_is_never_handed_out_twice() -> None:
    seen = [free_port() for _ in range(200)] + free_ports(50)
    assert len(set(seen)) == len(seen)


def test_a_reserved_port_is_never_drawn(monkeypatch) -> None:
    # Ten candidates (65526-65535), five reserved (as `llm-mesh up --port` reserves its
    # gateway's): the other five come back.
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (10_240, 65_525))
    monkeypatch.setattr(ports, "_handed_out", set())
    ports.reserve_ports(range(65_526, 65_536, 2))
    assert sorted(free_ports(5)) == list(range(65_527, 65_536, 2))


def test_a_port_someone_holds_is_skipped(monkeypatch) -> None:
    # Leave ten candidates (65526-65535) and hold every other one: the rest come back. Another
    # server on this machine may hold a candidate already (CI once had one on 65526): a port it
    # holds counts as held, and one it holds among the rest is left out of what is expected.
    monkeypatch.setattr(ports, "_ephemeral_range", lambda: (10_240, 65_525))
    monkeypatch.setattr(ports, "_handed_out", set())
    held: list[socket.socket] = []
    try:
        for port in range(65_526, 65_536, 2):
            sock = socket.socket()
            held.append(sock)
            try:
                sock.bind(("127.0.0.1", port))
                sock.listen()
            except OSError:
                pass                    # someone else holds it: held all the same
        expected = [port for port in range(65_527, 65_536, 2) if _bindable(port)]
        assert expected, "every candidate is held by another process"
        assert sorted(free_ports(len(expected))) == expected
    finally:
        for sock in held:
            sock.close()


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
