"""A network namespace joined to this one by a veth pair, for tests whose processes must talk
across different addresses (not loopback): made with ``ip`` (iproute2, root), removed on exit
with its link (stop every process inside it first). Without root or ``ip`` the test skips, or
fails where the tools are required (CI: see tests/helpers/tools.py)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

from tools import require_tool, skip_or_fail


@dataclass(frozen=True)
class Namespace:
    name: str  # for ``ip netns exec``
    here: str  # this namespace's address on the link
    there: str  # the namespace's own address on the link


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def network_namespace() -> Iterator[Namespace]:
    if os.geteuid() != 0:
        skip_or_fail("a network namespace needs root (ip netns add); run the test as root")
    require_tool("ip", "iproute2")
    tag = secrets.token_hex(4)  # link names hold at most 15 bytes
    name, here_link, there_link = f"tpusync-{tag}", f"tsh{tag}", f"tsn{tag}"
    subnet = f"10.{secrets.randbelow(250) + 2}.{secrets.randbelow(250) + 2}"
    space = Namespace(name, f"{subnet}.1", f"{subnet}.2")
    _ip("netns", "add", name)
    try:
        _ip("link", "add", here_link, "type", "veth", "peer", "name", there_link)
        try:
            _ip("link", "set", there_link, "netns", name)
            _ip("addr", "add", f"{space.here}/24", "dev", here_link)
            _ip("link", "set", here_link, "up")
            for args in (
                ("addr", "add", f"{space.there}/24", "dev", there_link),
                ("link", "set", there_link, "up"),
                ("link", "set", "lo", "up"),
            ):
                _ip("netns", "exec", name, "ip", *args)
            yield space
        finally:
            subprocess.run(["ip", "link", "del", here_link], capture_output=True, timeout=30)
    finally:
        _ip("netns", "del", name)
