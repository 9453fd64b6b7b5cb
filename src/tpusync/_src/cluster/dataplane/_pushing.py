"""One stripe of a push over one connection: the ``put`` request, the BLOCK frames straight
from the source's pinned slots, END, and the server's answer, all before the push's one
deadline (:mod:`tpusync._src.cluster.dataplane.deadlines`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tpusync._src.cluster._handshake import _ProtocolError
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane._answers import bool_list
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.frames import FrameBatch
from tpusync._src.cluster.dataplane.protocol import StreamError
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.pool import populate
from tpusync.errors import PeerUnavailableError

__all__ = ["push_stripe"]


def push_stripe(
    conn: Connection,
    ensure: Callable[[Connection], None],
    keys: list[bytes],
    slots: np.ndarray,
    checksums: np.ndarray,
    source: HostPool,
    deadline: Deadline,
) -> tuple[dict[bytes, bool], BaseException | None, bool]:
    """Pushes one stripe of ``source``'s pinned ``slots`` over ``conn`` (``ensure`` (re)connects
    it) before ``deadline``: returns the server's per-key answer, the failure that cut it short
    (then the keys not confirmed count as not stored; a missed deadline is a
    DeadlineExceededError) and whether the server had accepted the put."""
    layout = source.layout
    fingerprint, size = layout.fingerprint, layout.payload_bytes
    accepted = False
    try:
        ensure(conn)
        try:
            rid, answer = conn.send_put(keys, checksums.tolist(), deadline)
        except (EOFError, ConnectionError):
            conn.drop()  # an idle connection the server had just closed: ask once more
            ensure(conn)
            rid, answer = conn.send_put(keys, checksums.tolist(), deadline)
        accept = bool_list(answer, "accept", len(keys))
        present = bool_list(answer, "present", len(keys))
        accepted = True
        assert conn.sock is not None
        populate(source, slots)  # pages the batch's views will read
        batch = FrameBatch(conn.sock, source, deadline)
        try:
            for key, slot, checksum, take in zip(
                keys, slots.tolist(), checksums.tolist(), accept, strict=True
            ):
                if take:
                    batch.add(
                        wire.encode_header(wire.BLOCK, rid, key, fingerprint, size, checksum),
                        slot,
                    )
            batch.flush()
        finally:
            batch.release()
        done = bool_list(conn.finish_put(rid, fingerprint, deadline), "stored", len(keys))
    except (OSError, EOFError, StreamError, _ProtocolError, PeerUnavailableError) as exc:
        conn.drop()  # the stream's position is unknown
        return {}, exc, accepted
    return {k: p or d for k, p, d in zip(keys, present, done, strict=True)}, None, True
