"""Receiving one stripe of a pull over one connection: the frames of its blocks, natively
(:class:`_core.FrameReceiver`, the GIL released across blocks) or, under TLS, one at a time in
Python, each block judged against its recorded checksum (where it lands:
:mod:`tpusync._src.cluster.dataplane.stripes`)."""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tpusync._native import core as _core
from tpusync._src.cluster._handshake import _ProtocolError
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.protocol import MAX_ERROR_BYTES, StreamError
from tpusync._src.cluster.dataplane.stripes import _Stripe
from tpusync.errors import FrameError, PeerUnavailableError

__all__ = ["Link", "receive_stripe"]

log = logging.getLogger("tpusync._src.cluster.dataplane.client")


@dataclass(frozen=True)
class Link:
    """What receiving needs of its client: ``ensure(conn)`` (re)connects a connection unless
    the client is closed; ``timeout_s`` bounds reading an error message."""

    ensure: Callable[[Connection], None]
    timeout_s: float


def receive_stripe(
    conn: Connection, lease_id: int, stripe: _Stripe, deadline: Deadline, link: Link
) -> tuple[np.ndarray, int, int, BaseException | None]:
    """Receives ``stripe``'s blocks over ``conn``; returns the mask of verified blocks
    (over the whole pull), the corrupt count, the bytes received and the failure that
    ended the stream early (if any)."""
    error: BaseException | None = None
    try:
        link.ensure(conn)
        if isinstance(conn.sock, ssl.SSLSocket):  # TLS decrypts in Python's ssl
            _receive_frames_in_python(conn, lease_id, stripe, deadline, link)
        else:
            _receive_frames_natively(conn, lease_id, stripe, deadline, link)
    except (OSError, EOFError, FrameError, StreamError, _ProtocolError) as exc:
        error = exc
        conn.drop()  # the stream's position is unknown
    except PeerUnavailableError as exc:
        error = exc
    corrupt = int((stripe.complete & ~stripe.ok).sum())
    if corrupt:
        log.warning(
            "tpusync: pull from %s: %d blocks failed verification; dropped", conn.label, corrupt
        )
    return stripe.ok, corrupt, stripe.nbytes, error


def _receive_frames_natively(
    conn: Connection, lease_id: int, stripe: _Stripe, deadline: Deadline, link: Link
) -> None:
    """The stripe's frames through one :class:`_core.FrameReceiver` (the GIL released across
    blocks); the frames it does not expect are handled here, one at a time."""
    with stripe.landing():
        rid = conn.send_get(lease_id, stripe.keys)
        receiver = stripe.receiver(conn, rid)
        try:
            try:
                status = conn.receive_frames(receiver, deadline)
            except (EOFError, ConnectionError):
                if receiver.bytes_read:
                    raise
                # Closed before the first byte (an idle connection the server had just
                # timed out): nothing was written anywhere; ask once more, freshly connected.
                conn.drop()
                link.ensure(conn)
                rid = conn.send_get(lease_id, stripe.keys)
                receiver = stripe.receiver(conn, rid)
                status = conn.receive_frames(receiver, deadline)
            while status == _core.FRAMES_HEADER:  # a frame the receiver did not expect
                j = receiver.index
                header = wire.decode_header(receiver.header, max_payload=stripe.limit)
                if _frame_has_block(header, rid, conn, stripe.keys[j], stripe.size, link):
                    stripe.receive_block(conn, j, header, deadline)
                receiver.resume(j + 1)
                status = conn.receive_frames(receiver, deadline)
            _check_end(
                wire.decode_header(receiver.header, max_payload=stripe.limit), rid, conn, link
            )
        finally:
            stripe.take_results(receiver)
            del receiver  # before the memory it lands in may go


def _receive_frames_in_python(
    conn: Connection, lease_id: int, stripe: _Stripe, deadline: Deadline, link: Link
) -> None:
    """The stripe's frames one at a time through :meth:`Connection.recv_into`."""
    header_buf = bytearray(wire.HEADER_SIZE)
    header_view = memoryview(header_buf)
    rid = conn.send_get(lease_id, stripe.keys)
    try:
        conn.recv_into(header_view, deadline)
    except (EOFError, ConnectionError):
        # Closed before the first frame (an idle connection the server had just timed
        # out): nothing was written anywhere; ask once more on a fresh connection.
        conn.drop()
        link.ensure(conn)
        rid = conn.send_get(lease_id, stripe.keys)
        conn.recv_into(header_view, deadline)
    for j, key in enumerate(stripe.keys):
        if j:
            conn.recv_into(header_view, deadline)
        header = wire.decode_header(header_buf, max_payload=stripe.limit)
        if _frame_has_block(header, rid, conn, key, stripe.size, link):
            stripe.receive_block(conn, j, header, deadline)
    conn.recv_into(header_view, deadline)
    _check_end(wire.decode_header(header_buf, max_payload=stripe.limit), rid, conn, link)


def _frame_has_block(
    header: wire.FrameHeader, rid: int, conn: Connection, key: bytes, size: int, link: Link
) -> bool:
    """Whether the frame of block ``key`` carries its payload (BLOCK) or not (MISSING);
    raises StreamError for anything else."""
    _check_frame(header, rid, conn, link)
    if header.frame_type == wire.END:
        raise StreamError("the response ended early")
    if header.key != key:
        raise StreamError(f"a frame for {header.key.hex()}, expected {key.hex()}")
    if header.frame_type == wire.MISSING:
        return False
    if header.payload_length != size:
        raise StreamError(f"a block of {header.payload_length} B, expected {size}")
    return True


def _check_end(header: wire.FrameHeader, rid: int, conn: Connection, link: Link) -> None:
    _check_frame(header, rid, conn, link)
    if header.frame_type != wire.END:
        raise StreamError(f"a {header.type_name} frame after the last block")


def _check_frame(header: wire.FrameHeader, rid: int, conn: Connection, link: Link) -> None:
    if header.request_id != rid:
        raise StreamError(f"a frame for request {header.request_id}, expected {rid}")
    if header.frame_type == wire.ERROR:
        if header.payload_length > MAX_ERROR_BYTES:
            raise StreamError(f"an error message of {header.payload_length} B")
        message = bytearray(header.payload_length)
        conn.recv_into(memoryview(message), time.monotonic() + link.timeout_s)
        raise StreamError(f"the server failed the request: {message.decode('utf-8', 'replace')}")
