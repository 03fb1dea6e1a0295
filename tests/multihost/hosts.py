"""Hosts for multi-host tests: network namespaces, each joined by a veth pair to one bridge,
so processes "on" different hosts talk over a real network stack (their own interfaces,
addresses and ports); the root namespace joins the bridge too, so the test reaches every
host.

The bridge lives in a namespace of its own (the switch), not in the root namespace: with
br_netfilter loaded, bridged frames pass the iptables FORWARD chain of the bridge's
namespace, and dockerd sets the root namespace's policy to DROP. The switch's chains are
its own and empty, so the hosts reach each other whatever the machine's firewall says.

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
    switch, bridge, uplink = f"ms{tag}", f"mb{tag}", f"vr{tag}"
    made: list[Host] = []
    try:
        _ip("netns", "add", switch)
        _ip("-n", switch, "link", "add", bridge, "type", "bridge")
        _ip("-n", switch, "link", "set", bridge, "up")
        _plug(switch, bridge, uplink, f"vs{tag}")
        _ip("addr", "add", f"{subnet}.254/24", "dev", uplink)
        _ip("link", "set", uplink, "up")
        for i in range(count):
            host = Host(f"mh{tag}{i}", f"{subnet}.{i + 1}")
            _ip("netns", "add", host.name)
            made.append(host)
            inside = f"vp{tag}{i}"
            _plug(switch, bridge, inside, f"vh{tag}{i}")
            _ip("link", "set", inside, "netns", host.name)
            for args in (["addr", "add", f"{host.ip}/24", "dev", inside],
                         ["link", "set", inside, "up"], ["link", "set", "lo", "up"]):
                _ip("-n", host.name, *args)
        yield made
    finally:
        for host in made:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        subprocess.run(["ip", "netns", "del", switch], capture_output=True)
        # NOTE: the kernel frees a deleted namespace's veth peers later, not at once.
        subprocess.run(["ip", "link", "del", uplink], capture_output=True)


def _plug(switch: str, bridge: str, end: str, port: str) -> None:
    """A veth pair: `end` here, `port` on the switch's bridge."""
    _ip("link", "add", end, "type", "veth", "peer", "name", port)
    _ip("link", "set", port, "netns", switch)
    _ip("-n", switch, "link", "set", port, "master", bridge, "up")


def kill_host(host: Host) -> None:
    """Every process on the host killed at once (SIGKILL), as a machine that loses power."""
    pids = subprocess.run(["ip", "netns", "pids", host.name], capture_output=True,
                          text=True).stdout.split()
    if pids:
        subprocess.run(["kill", "-9", *pids], capture_output=True)

