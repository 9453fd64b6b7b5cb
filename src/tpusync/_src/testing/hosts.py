"""Hosts for the multi-host tests and benchmarks: network namespaces on one switch (a bridge in
this namespace), each with one link whose both directions are shaped with ``tc`` (tbf) to a
rate, as a host's NIC and its switch port are. This namespace has an address on the switch
too (for a registry the hosts share). Made with ``ip`` and ``tc`` (iproute2, root); removed on
exit, also on error (stop every process inside first)."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["Host", "Switch", "hosts_on_a_switch"]


@dataclass(frozen=True)
class Host:
    """A namespace: ``ip netns exec <name>`` runs in it; ``address`` is its own."""

    name: str
    address: str
    device: str  # its end of the link, inside it

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host."""
        return ["ip", "netns", "exec", self.name, *argv]

    def sent_bytes(self) -> int:
        """The bytes this host has sent over its link."""
        out = subprocess.run(
            self.command(["cat", f"/sys/class/net/{self.device}/statistics/tx_bytes"]),
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return int(out.stdout)


@dataclass(frozen=True)
class Switch:
    """The hosts, and this namespace's address on their switch."""

    address: str
    hosts: list[Host]


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=30)


def _shape(prefix: list[str], device: str, rate_mbit: int) -> None:
    burst = max(rate_mbit * 125_000 // 100, 256 << 10)  # 10 ms at the rate, at least 256 KiB
    _run(*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
         f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


@contextlib.contextmanager
def hosts_on_a_switch(count: int, rate_mbit: int) -> Iterator[Switch]:
    """``count`` hosts on one switch, each link shaped to ``rate_mbit`` both ways."""
    tag = secrets.token_hex(3)  # link names hold at most 15 bytes
    subnet = f"10.{secrets.randbelow(200) + 20}.{secrets.randbelow(250) + 2}"
    bridge = f"tsw{tag}"
    made: list[str] = []
    _run("ip", "link", "add", bridge, "type", "bridge")
    try:
        _run("ip", "addr", "add", f"{subnet}.1/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        hosts = []
        for i in range(count):
            name, port = f"tpusync-{tag}-h{i}", f"tsp{tag}{i:02d}"
            _run("ip", "netns", "add", name)
            made.append(name)
            _run("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "link", "set", port, "master", bridge)
            _run("ip", "link", "set", port, "up")
            host = Host(name, f"{subnet}.{i + 2}", "eth0")
            inside = ["ip", "netns", "exec", name]
            _run(*inside, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
            _run(*inside, "ip", "link", "set", "eth0", "up")
            _run(*inside, "ip", "link", "set", "lo", "up")
            _shape(inside, "eth0", rate_mbit)  # the host's uplink
            _shape([], port, rate_mbit)  # the switch port towards it: its downlink
            hosts.append(host)
        yield Switch(f"{subnet}.1", hosts)
    finally:
        for name in reversed(made):  # the veth pair goes with its namespace
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, timeout=30)
