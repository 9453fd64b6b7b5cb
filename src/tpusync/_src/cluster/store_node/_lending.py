"""What a store node lends per block layout (:class:`Lent`), the room check before it lends, and
the receive helpers of a put."""

from __future__ import annotations

import collections
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.leases import LeaseTable
from tpusync._src.cluster.dataplane.server import Served
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.files import check_directory, check_shm_dir
from tpusync._src.tiers.room import check_room, check_writable_directory, held_bytes
from tpusync.errors import InvalidArgumentError

__all__ = ["Lent", "check_room_to_lend", "checksums_param", "recv_exactly", "recv_header"]

log = logging.getLogger(__name__)


MAX_SLOT_BYTES = 1 << 30  # a block bigger than this is not a KV block: refuse the layout
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,80}$")


class Lent:
    """One layout's pool on a store node (and its optional disk pool), its leases and the LRU
    orders (oldest first)."""

    def __init__(
        self,
        pool: HostPool,
        clock: Callable[[], float],
        disk: DiskPool | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
        *,
        lease_max_s: float,
    ) -> None:
        self.pool = pool
        self.disk = disk
        leases = LeaseTable(pool, clock=clock, max_lifetime_s=lease_max_s, on_failure=on_failure)
        self.served = Served(pool, leases)
        self.lock = threading.Lock()  # making room and reserving, one put at a time
        self.lru: collections.OrderedDict[bytes, None] = collections.OrderedDict.fromkeys(
            pool.keys()
        )
        self.disk_lru: collections.OrderedDict[bytes, None] = collections.OrderedDict.fromkeys(
            [] if disk is None else disk.keys()
        )

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Held in DRAM or on disk."""
        held = self.pool.contains(keys)
        if self.disk is not None:
            held = [a or b for a, b in zip(held, self.disk.contains(keys), strict=True)]
        return held

    def keys(self) -> list[bytes]:
        keys = dict.fromkeys(self.pool.keys())
        if self.disk is not None:
            keys.update(dict.fromkeys(self.disk.keys()))
        return list(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.lru[key] = None
                self.lru.move_to_end(key)


def check_room_to_lend(
    dram_bytes: int,
    name: str | None,
    shm_dir: str,
    disk_dir: str | os.PathLike[str] | None,
    disk_bytes: int,
) -> None:
    """Refuses what this host cannot lend (the pools are made later, at a client's first
    hello): memory (and, for named pools, an ``shm_dir`` another user could tamper with, or
    its room), and a disk directory that is missing, not writable, a symlink, another uid's,
    writable by others, or too small. A restarted node's own files count as room."""
    if name is None:
        check_room("dram_bytes", dram_bytes, fix="lend less DRAM")
    else:
        check_shm_dir(shm_dir, "shm_dir")  # another user's, or a symlink: refused
        check_writable_directory("shm_dir", shm_dir)
        held = held_bytes(sorted(Path(shm_dir).glob(f"tpusync-{name}-*.pool")))
        check_room("dram_bytes", dram_bytes, held=held, fix="lend less DRAM")
        check_room(
            "dram_bytes",
            dram_bytes,
            directory=shm_dir,
            held=held,
            fix="lend less DRAM, or enlarge shm_dir (e.g. docker run --shm-size)",
        )
    if disk_dir is not None:
        check_writable_directory("disk_dir", disk_dir)
        # the parent of the per-layout disk pools: this uid's alone, as a disk pool's own
        check_directory(disk_dir, argument="disk_dir")
        held = held_bytes(sorted(Path(disk_dir).glob(f"{name or 'node'}-*")))
        check_room("disk_bytes", disk_bytes, directory=disk_dir, held=held, fix="lend less disk")


def checksums_param(value: Any, n: int) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) != n
        or not all(type(c) is int and 0 <= c < 2**64 for c in value)
    ):
        raise InvalidArgumentError(f"checksums: expected {n} integers in 0..2**64-1")
    return value


def recv_header(conn: socket.socket, deadline: Deadline) -> bytes:
    header = bytearray(wire.HEADER_SIZE)
    recv_exactly(conn, memoryview(header), deadline)
    return bytes(header)


def recv_exactly(conn: socket.socket, view: memoryview, deadline: Deadline) -> None:
    """Fills ``view`` from ``conn`` before ``deadline`` (the put's), each read waiting at most
    the connection's timeout (the peer's longest silence). A read in Python at a time, each
    ending with what arrived, so that a peer sending a byte now and then cannot stretch it: the
    paths that use it are TLS (which decrypts in Python anyway) and a frame that differs from
    its declaration."""
    got, n = 0, view.nbytes
    silence = conn.gettimeout()
    wait_set = silence  # what the socket waits at most, as last set
    try:
        while got < n:
            left = deadline.left()
            if left <= 0:
                raise deadline.missed()
            wait = left if silence is None else min(silence, left)
            if wait != wait_set:  # a system call: only in the last silence before the deadline
                conn.settimeout(wait)
                wait_set = wait
            try:
                r = conn.recv_into(view[got:], n - got)
            except TimeoutError:
                if deadline.left() <= 0:
                    raise deadline.missed() from None
                raise TimeoutError(f"the peer sent nothing for {silence} s mid-put") from None
            if r == 0:
                raise EOFError("the peer closed the connection mid-put")
            got += r
    finally:
        if wait_set != silence:
            conn.settimeout(silence)
