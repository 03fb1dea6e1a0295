"""Hosts for multi-host tests: network namespaces, each joined to one bridge in the root
namespace by a veth pair, so processes "on" different hosts talk over a real network stack
(their own interfaces, addresses and ports) and the test reaches every host from the root.

Making namespaces needs root (CAP_NET_ADMIN); `unavailable()` says why a machine cannot."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Host:
    name: str        # its network namespace
    ip: str

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.name, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    name = f"mhprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "the `ip` command (iproute2) is not installed"
    except subprocess.CalledProcessError as exc:
        return f"cannot make a network namespace (needs root): {exc.stderr.strip()}"
    _ip("netns", "del", name)
    return None


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """`count` hosts on a private /24, the root namespace at .254; removed at exit (with
    every interface in them)."""
    tag = secrets.token_hex(3)
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 1}"
    bridge = f"mb{tag}"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i in range(count):
            host = Host(f"mh{tag}{i}", f"{subnet}.{i + 1}")
            _ip("netns", "add", host.name)
            made.append(host)
            outside, inside = f"vh{tag}{i}", f"vp{tag}{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", host.name)
            _ip("link", "set", outside, "master", bridge, "up")
            for args in (["addr", "add", f"{host.ip}/24", "dev", inside],
                         ["link", "set", inside, "up"], ["link", "set", "lo", "up"]):
                _ip("-n", host.name, *args)
        yield made
    finally:
        for host in made:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def kill_host(host: Host) -> None:
    """Every process on the host killed at once (SIGKILL), as a machine that loses power."""
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                          text=True).stdout.split()
    if pids:
        subprocess.run(["kill", "-9", *pids], capture_output=True)

