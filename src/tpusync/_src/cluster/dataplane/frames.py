"""Block frames over sockets, below the protocol: sending buffers in one GIL-free call, batching
a response's frames from pinned slots, and the native receiver of a stream of BLOCK frames into
reserved slots (both directions of the data plane use them: a pull's response and a push).
The frame format itself is ``wire.py``'s."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import ssl
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.tiers.blocks import CHECKSUM_SCHEME
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.pool import memory_base, populate
from tpusync._src.tiers.layout import PoolLayout

__all__ = [
    "LOCAL_SEND_BUFFER_BYTES",
    "SEND_BATCH_BYTES",
    "FrameBatch",
    "frame_receiver",
    "send_buffers",
    "slot_addresses",
    "tune_for_peer",
]


def send_buffers(
    sock: socket.socket, buffers: Sequence[Any], deadline: Deadline | None = None
) -> None:
    """Sends every buffer in order with ``sendmsg`` (no joining copy), handling short sends;
    raises TimeoutError when the peer takes nothing for the socket's timeout, and
    DeadlineExceededError once ``deadline`` passed (however little the peer takes at a time)."""
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS: the record layer copies anyway
        _send_tls(sock, buffers, deadline)
        return
    # one GIL-free call for the whole frame: short sends and waits for room loop in C
    timeout = sock.gettimeout()
    timeout = 1e9 if timeout is None else timeout
    if deadline is None:
        _core.send_all(sock.fileno(), list(buffers), timeout)
        return
    left = deadline.left()
    if left <= 0:
        raise deadline.missed()
    try:
        _core.send_all(sock.fileno(), list(buffers), timeout, left)
    except TimeoutError as exc:
        if deadline.left() <= 0:
            raise deadline.missed() from exc
        raise


TLS_SEND_STEP = 16 << 10  # a TLS record: the deadline is checked between them


def _send_tls(sock: ssl.SSLSocket, buffers: Sequence[Any], deadline: Deadline | None) -> None:
    if deadline is None:
        for buffer in buffers:
            if len(buffer):
                sock.sendall(buffer)
        return
    timeout = sock.gettimeout()
    view = None
    try:
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            for start in range(0, view.nbytes, TLS_SEND_STEP):
                left = deadline.left()
                if left <= 0:
                    raise deadline.missed()
                sock.settimeout(left if timeout is None else min(timeout, left))
                try:
                    sock.sendall(view[start : start + TLS_SEND_STEP])
                except TimeoutError as exc:
                    if deadline.left() <= 0:
                        raise deadline.missed() from exc
                    raise
    finally:
        view = buffer = None  # a failure's traceback must not hold them
        sock.settimeout(timeout)


SEND_BATCH_BYTES = 4 << 20

# The send buffer of a connection whose peer is on this host (the kernel doubles it). Its
# autotuned default grows to 4 MiB, and that much in flight over loopback costs both ends CPU
# per byte (docs/decisions/0003). Across hosts it stays autotuned: a fixed buffer would cap a
# connection at buffer / RTT.
LOCAL_SEND_BUFFER_BYTES = 256 << 10


def tune_for_peer(sock: socket.socket) -> None:
    """Sizes the send buffer of a connected socket whose peer is on this host (a loopback
    address, or the socket's own address); leaves any other alone, and TLS (whose record
    writes ran slower with the small buffer: docs/decisions/0003)."""
    if isinstance(sock, ssl.SSLSocket):
        return
    try:
        local, peer = sock.getsockname()[0], sock.getpeername()[0]
        address = ipaddress.ip_address(peer.split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # a dual-stack socket's view of 127.x
        if peer == local or address.is_loopback:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SEND_BUFFER_BYTES)
    except (OSError, ValueError, TypeError, IndexError):  # not an IP socket: nothing to tune
        pass


class FrameBatch:
    """Frames queued for one :func:`send_buffers` call: headers, and the payloads of pinned
    (and mapped) slots as views of the pool's memory (held until sent), sent once
    SEND_BATCH_BYTES of payload are queued and on :meth:`flush`, every one before
    ``deadline`` (when given)."""

    def __init__(
        self, conn: socket.socket, pool: HostPool, deadline: Deadline | None = None
    ) -> None:
        self._conn = conn
        self._deadline = deadline
        self._pool = pool
        self._size = pool.layout.payload_bytes
        self._memory: memoryview | None = None
        self._base = 0
        self._buffers: list[Any] = []
        self._bytes = 0

    def add(self, header: bytes, slot: int | None = None) -> None:
        self._buffers.append(header)
        if slot is None:
            return
        if self._memory is None:  # one view of the pool's memory: close() refuses meanwhile
            self._memory = memoryview(memory_base(self._pool))
            self._base = self._pool.geometry.data_offset
        start = self._base + slot * self._pool.layout.slot_bytes
        self._buffers.append(self._memory[start : start + self._size])
        self._bytes += self._size
        if self._bytes >= SEND_BATCH_BYTES:
            self.flush()

    def flush(self) -> None:
        try:
            if self._buffers:
                send_buffers(self._conn, self._buffers, self._deadline)
        finally:
            # emptied in place: a failure's traceback holds this list, and must not hold the
            # views of the pool's memory in it (the pool could not close)
            self._buffers.clear()
            self._bytes = 0

    def release(self) -> None:
        """Drops what was not sent and lets go of the pool's memory."""
        self._buffers.clear()
        if self._memory is not None:
            self._memory.release()
            self._memory = None


@contextlib.contextmanager
def slot_addresses(pool: HostPool, slots: np.ndarray) -> Iterator[np.ndarray]:
    """The payload addresses of ``slots`` (their pages mapped first), valid inside the block: a
    view of the pool's memory is held meanwhile, so the pool refuses to close."""
    populate(pool, slots)
    with memoryview(memory_base(pool)) as memory:
        base = np.frombuffer(memory, np.uint8).ctypes.data + pool.geometry.data_offset
        yield (base + np.asarray(slots, np.int64) * pool.layout.slot_bytes).astype(np.uint64)


def frame_receiver(
    sock: socket.socket,
    request_id: int,
    keys: list[bytes],
    layout: PoolLayout,
    checksums: np.ndarray,
    addresses: np.ndarray | None,
    runs: tuple[np.ndarray, ...] | None = None,
) -> _core.FrameReceiver:
    """A native receiver of the BLOCK frames of ``keys`` (in order) for ``request_id``, each
    with its recorded checksum, into the slots at ``addresses`` (or scattered over ``runs``:
    see :class:`_core.FrameReceiver`)."""
    checksums = np.ascontiguousarray(checksums, dtype=np.uint64)
    size = layout.payload_bytes
    headers = _core.block_frame_headers(
        request_id, keys, layout.fingerprint, size, checksums, CHECKSUM_SCHEME
    )
    return _core.FrameReceiver(
        sock.fileno(), headers, addresses, checksums, size, *layout.piece_table, runs=runs
    )
