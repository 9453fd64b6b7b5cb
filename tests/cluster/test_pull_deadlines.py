"""Absolute deadlines no peer can move: a pull's cap past which no
lease renewal carries it (``max_pull_s``), a lease's whole life on the server (``lease_max_s``),
one deadline for a whole push (``max_push_s``) and for the native send under it.

The hostile peers here trickle: a server that sends a block a byte at a time and grants every
renewal, a store node that takes a push a byte at a time. Each keeps its connection alive (never
silent for the client's ``timeout_s``), so only an absolute deadline ends the operation; without
one these tests would wait minutes. Bounds are the limit plus a margin that holds at 5x load.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from preauth_child import LAYOUT, key_for, payload_for
from test_peer_isolation import Clock, fill
from tools import self_signed_tls

from tpusync._native import core as _core
from tpusync._src.cluster._handshake import _send_json
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.deadlines import (
    DEFAULT_FLOOR_BYTES_PER_S,
    DEFAULT_FLOOR_S,
    Deadline,
    limit_for,
)
from tpusync._src.testing.polling import eventually
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    BlockServerOptions,
    LeaseTable,
    PeerCircuits,
    StoreNode,
    StoreServer,
)
from tpusync.errors import CircuitOpenError, DeadlineExceededError, InvalidArgumentError
from tpusync.tiers import HostPool

SECRET = bytes(range(60, 92))
TRICKLE_S = 0.05  # a hostile peer's pace: a byte this often (never silent for timeout_s)
TIMEOUT_S = 5.0  # the client's longest silence: the trickle never reaches it
MARGIN_S = 10.0  # on top of a limit: what a loaded machine may add (never the limit's cause)
WAIT_S = 30.0


class TricklingServer(BlockServer):
    """Sends each block's frame a byte every TRICKLE_S (a wedged or hostile server that keeps
    the stream alive) and grants every lease renewal; counts the renewals it granted."""

    def __init__(self, pool: HostPool, **options: Any) -> None:
        self.stop = threading.Event()
        self.renewed = 0
        super().__init__(pool, secret=SECRET, **options)

    def _renew(self, served: Any, params: dict[str, Any]) -> bool:
        granted = super()._renew(served, params)
        self.renewed += granted
        return granted

    def _send_block(self, conn: socket.socket, header: bytes, payload: memoryview) -> None:
        for byte in bytes(header) + bytes(payload):
            if self.stop.wait(TRICKLE_S):
                raise ConnectionAbortedError("the test is over")
            conn.sendall(bytes([byte]))


@contextmanager
def trickling(**options: Any) -> Iterator[TricklingServer]:
    with HostPool(LAYOUT, 4) as pool:
        fill(pool, [key_for(0)], 0)
        server = TricklingServer(pool, **options)
        try:
            yield server
        finally:
            server.stop.set()
            server.close()


def test_a_trickling_server_that_keeps_renewing_cannot_hold_a_pull_past_max_pull_s() -> None:
    """Before the cap, a server that trickled a byte every 50 ms and renewed every lease held a
    pull for as long as its block took (16 KiB: 14 minutes). Now the pull ends at max_pull_s,
    after renewals moved its lease's deadline past the first one (2.4 s -> 4 s), and the
    server's circuit opens (a missed deadline)."""
    ttl, limit = 3.0, 4.0  # the lease's first deadline: 0.8 * 3 s; renewals every 1 s
    circuits = PeerCircuits()
    with (
        trickling(lease_ttl_s=ttl) as server,
        BlockClient(
            server.address, secret=SECRET, timeout_s=TIMEOUT_S, max_pull_s=limit,
            same_host=False, circuits=circuits,
        ) as client,
        HostPool(LAYOUT, 4) as target,
    ):  # fmt: skip
        started = time.monotonic()
        result = client.pull_result([key_for(0)], target)
        took = time.monotonic() - started
        assert result.loaded == [False]
        assert isinstance(result.error, DeadlineExceededError), result.error
        assert isinstance(result.error, TimeoutError)
        assert "max_pull_s=4 s" in str(result.error), result.error
        assert "BlockClient(..., max_pull_s=...)" in str(result.error)
        assert server.renewed >= 1  # the lease was moved on, and still the pull ended
        assert limit * 0.9 <= took < limit + MARGIN_S, took
        assert circuits.state(server.address) == "open"
        with pytest.raises(CircuitOpenError):  # the next request skips it at once
            client.pull([key_for(0)], target)
        assert not target.contains([key_for(0)])[0]


def test_a_lease_lives_at_most_max_lifetime_s_however_often_it_is_renewed() -> None:
    clock = Clock()
    keys = [key_for(i) for i in range(2)]
    with HostPool(LAYOUT, 4) as pool:
        fill(pool, keys, 0)
        with LeaseTable(pool, clock=clock, max_lifetime_s=10.0) as table:
            lease = table.acquire(keys, 4.0)
            assert lease.ttl_s == 4.0
            for _ in range(2):  # renewed at 3 s and 6 s: to 7 s and 10 s
                clock.now += 3.0
                assert table.renew(lease.lease_id, 4.0)
            assert pool.delete(keys) == 0  # pinned
            clock.now += 3.0  # at 9 s, a renewal to 13 s would pass the 10 s of its life
            assert not table.renew(lease.lease_id, 4.0)
            assert table.renewals_refused == 1
            assert table.lookup(lease.lease_id) is not None  # it runs on to 10 s
            clock.now += 1.0
            assert table.lookup(lease.lease_id) is None
            assert not table.release(lease.lease_id)  # its reader must discard what it read
            assert pool.delete(keys) == 2  # unpinned
            assert table.acquire(keys, 60.0).ttl_s == 10.0  # a TTL beyond its life is cut
        with pytest.raises(InvalidArgumentError, match="max_lifetime_s"):
            LeaseTable(pool, max_lifetime_s=0)


def test_a_client_that_keeps_renewing_pins_nothing_past_lease_max_s() -> None:
    """A real server and a client that holds a lease and renews it every third of its TTL for
    as long as its `with` lasts: after lease_max_s the server refuses the renewals, the hold
    lapses and the blocks are unpinned (deletable) while the client still holds on."""
    with HostPool(LAYOUT, 4) as pool:
        fill(pool, [key_for(1)], 1)
        with (
            BlockServer(pool, secret=SECRET, lease_ttl_s=1.5, lease_max_s=3.0) as server,
            BlockClient(server.address, secret=SECRET, same_host=False) as client,
            client.hold([key_for(1)]) as held,
        ):
            assert held.present == [True]
            eventually(
                lambda: held.lapsed and not len(server.leases),
                WAIT_S,
                "the lease's end at lease_max_s",
            )
            assert server.leases.renewals_refused >= 1
            assert pool.delete([key_for(1)]) == 1


def test_a_slow_reader_of_a_get_holds_its_pins_no_longer_than_lease_max_s() -> None:
    """A client leases 1 MiB of blocks, asks for them, and reads the stream 1 KiB every 50 ms
    (never silent for the server's io_timeout_s): the server's get pins every block it sends
    until the send ends, and a per-send timeout never ended it. Now the get's frames must leave
    within lease_max_s: the server closes the connection, counts the peer, and the blocks can
    be deleted while the reader still reads."""
    keys = [key_for(i) for i in range(64)]
    with HostPool(LAYOUT, len(keys)) as pool:
        fill(pool, keys, 0)
        with (
            BlockServer(pool, secret=SECRET, lease_ttl_s=0.5, lease_max_s=1.0) as server,
            BlockClient(server.address, secret=SECRET, same_host=False) as client,
        ):
            conn = client._conns[0]  # the protocol by hand: a get nobody reads in time
            lease = conn.call("acquire", {"keys": [k.hex() for k in keys]})
            assert conn.sock is not None
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.send_get(lease["lease"], keys)
            conn.sock.settimeout(TIMEOUT_S)
            read = deleted = 0
            deadline = time.monotonic() + WAIT_S
            while deleted < len(keys):  # pinned by the get (its lease lapses in 0.5 s)
                assert time.monotonic() < deadline, "the slow reader kept the blocks pinned"
                time.sleep(TRICKLE_S)
                chunk = conn.sock.recv(1024)
                read += len(chunk)
                deleted += pool.delete(keys)
                if not chunk:  # the server closed the connection (after it unpinned them)
                    break
            assert deleted + pool.delete(keys) == len(keys)
            assert read < len(keys) * LAYOUT.payload_bytes  # it was cut off mid-stream
            while "missed a deadline" not in server.refusals():
                assert time.monotonic() < deadline, server.refusals()
                time.sleep(TRICKLE_S)
            conn.drop()


@pytest.mark.parametrize(
    "options, match",
    [
        ({"lease_max_s": 0}, "lease_max_s: expected seconds in"),
        ({"lease_max_s": True}, "lease_max_s: expected seconds in"),
        ({"lease_ttl_s": 20.0, "lease_max_s": 10.0}, "lease_max_s: expected at least lease_ttl_s"),
    ],
)
def test_bad_lease_lifetimes_are_refused_naming_the_option(
    options: dict[str, Any], match: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        BlockServerOptions(secret=SECRET, **options)


def test_lease_lifetime_defaults() -> None:
    assert BlockServerOptions(secret=SECRET).lease_lifetime_s == 600.0
    assert BlockServerOptions(secret=SECRET, lease_ttl_s=900).lease_lifetime_s == 900.0
    assert BlockServerOptions(secret=SECRET, lease_max_s=30).lease_lifetime_s == 30.0
    with StoreNode(4 << 20, secret=SECRET, lease_max_s=30.0) as node:  # `serve --lease-max`
        assert node.server.options.lease_lifetime_s == 30.0
        with BlockClient(node.address, secret=SECRET, layout=LAYOUT) as client:
            assert client.writable  # its pool for LAYOUT is made: its leases live 30 s at most
        (lent,) = node.server._lent.values()
        assert lent.served.leases.max_lifetime_s == 30.0


@pytest.mark.parametrize("option", ["max_pull_s", "max_push_s"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "5", True, 1e9])
def test_bad_operation_limits_are_refused_naming_the_option(option: str, value: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=f"^{option}: expected seconds"):
        BlockClient("127.0.0.1:1", secret=SECRET, **{option: value})


def test_default_limits_scale_with_the_bytes_and_caps_never_move() -> None:
    assert limit_for(None, 0) == DEFAULT_FLOOR_S
    assert limit_for(None, 64 * DEFAULT_FLOOR_BYTES_PER_S) == DEFAULT_FLOOR_S + 64
    assert limit_for(7.0, 1 << 40) == 7.0
    now = time.monotonic()
    deadline = Deadline(now + 1, now + 5, option="max_pull_s", limit_s=5, what="pull from x")
    deadline.move_to(now + 3)
    assert deadline.at == now + 3
    deadline.move_to(now + 60)  # a renewal cannot carry it past the cap
    assert deadline.at == now + 5
    assert "max_pull_s=5 s" in str(deadline.missed())
    lease_bound = deadline.bounded(now + 2)
    assert "lease's deadline passed" in str(lease_bound.missed())


# -- a push ------------------------------------------------------------------------------------


class TricklingStore(BlockServer):
    """A "store node" that accepts every put and then takes its frames a byte every TRICKLE_S
    (a small receive buffer, so the pusher's sends block on it)."""

    def __init__(self, pool: HostPool, tls: ssl.SSLContext | None) -> None:
        self.stop = threading.Event()
        self.taken = 0
        super().__init__(pool, secret=SECRET, tls=tls)

    def _streams(self) -> dict[str, Any]:
        return {**super()._streams(), "put": self._trickle_put}

    def _trickle_put(
        self, conn: socket.socket, served: Any, rid: int, params: dict[str, Any]
    ) -> bool:
        n = len(params.get("keys", []))
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        _send_json(conn, {"id": rid, "result": {"accept": [True] * n, "present": [False] * n}})
        while not self.stop.wait(TRICKLE_S):
            if not conn.recv(1):
                return False
            self.taken += 1
        return False


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_a_trickling_store_cannot_hold_a_push_past_max_push_s(
    caplog: pytest.LogCaptureFixture, tmp_path: Path, encrypted: bool
) -> None:
    """Before, each send waited at most timeout_s for room, and a store taking a byte every
    50 ms (never silent that long) held a push of 4 MiB for days. Now the whole push ends at
    max_push_s: its keys are not stored, the miss is logged naming the option, and the store's
    circuit opens. Under TLS the frames go out a record at a time, the deadline checked
    between them."""
    server_tls, client_tls = self_signed_tls(tmp_path) if encrypted else (None, None)
    limit = 2.0
    keys = [key_for(i) for i in range(256)]  # 4 MiB: far more than the sockets buffer
    circuits = PeerCircuits()
    with HostPool(LAYOUT, len(keys)) as source:
        fill(source, keys, 0)
        store = TricklingStore(source, server_tls)
        try:
            with BlockClient(
                store.address, secret=SECRET, timeout_s=TIMEOUT_S, max_push_s=limit,
                same_host=False, circuits=circuits, tls=client_tls,
            ) as client:  # fmt: skip
                assert client.writable
                started = time.monotonic()
                with caplog.at_level(logging.WARNING, "tpusync.cluster"):
                    stored = client.push(keys, source)
                took = time.monotonic() - started
                assert stored == [False] * len(keys)
                assert "max_push_s=2 s" in caplog.text, caplog.text
                assert store.taken > 0  # it was taking bytes, never silent for timeout_s
                assert limit * 0.9 <= took < limit + MARGIN_S, took
                assert circuits.state(store.address) == "open"
                with pytest.raises(CircuitOpenError):
                    client.push(keys[:1], source)
        finally:
            store.stop.set()
            store.close()


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "tls"])
def test_a_pusher_that_trickles_holds_a_store_nodes_slots_no_longer_than_lease_max_s(
    tmp_path: Path, encrypted: bool
) -> None:
    """The other side: a client starts a put of 4 blocks (the node reserves their slots) and
    sends its frames a byte every 50 ms (never silent for the node's io_timeout_s). The node's
    receive ends at lease_max_s: the reservation is aborted (every slot free again), the peer
    is counted as one that missed a deadline, and its connection is closed."""
    server_tls, client_tls = self_signed_tls(tmp_path) if encrypted else (None, None)
    keys = [key_for(i) for i in range(4)]
    with (
        HostPool(LAYOUT, len(keys)) as source,
        StoreServer(
            4 << 20, secret=SECRET, lease_ttl_s=1.0, lease_max_s=1.0, tls=server_tls
        ) as server,
        BlockClient(
            server.address, secret=SECRET, layout=LAYOUT, same_host=False, tls=client_tls
        ) as client,
    ):
        fill(source, keys, 0)
        conn = client._conns[0]  # the protocol by hand: a put whose frames crawl
        pinned = source.pin(keys)
        try:
            rid, answer = conn.send_put(keys, pinned.checksums.tolist())
            assert answer["accept"] == [True] * len(keys)
            (pool,) = server.pools
            assert pool.free == pool.capacity - len(keys)  # reserved for the put
            size = LAYOUT.payload_bytes
            header = wire.encode_header(
                wire.BLOCK, rid, keys[0], LAYOUT.fingerprint, size, int(pinned.checksums[0])
            )
        finally:
            source.unpin(pinned)
        assert conn.sock is not None
        deadline = time.monotonic() + WAIT_S
        for byte in header + payload_for(0):
            assert time.monotonic() < deadline, "the node waited for the crawling put"
            try:
                conn.sock.sendall(bytes([byte]))
            except OSError:
                break  # the node closed the connection
            if "missed a deadline" in server.refusals():
                break
            time.sleep(TRICKLE_S)
        while "missed a deadline" not in server.refusals() or pool.free != pool.capacity:
            assert time.monotonic() < deadline, (server.refusals(), pool.free)
            time.sleep(TRICKLE_S)
        conn.drop()


def test_the_native_send_ends_at_its_budget_however_the_peer_trickles() -> None:
    """`send_all`'s budget bounds the whole call: a reader that takes 4 KiB every 50 ms keeps
    each wait for room under its timeout (5 s), and the budget (0.5 s) still ends the call
    (1 MiB at that pace would take 12 s)."""
    listener = socket.create_server(("127.0.0.1", 0))
    ours = socket.create_connection(listener.getsockname())
    theirs, _ = listener.accept()
    listener.close()
    stop = threading.Event()
    taken = [0]
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)

    def trickle() -> None:
        while not stop.wait(TRICKLE_S):
            try:
                taken[0] += len(theirs.recv(4096))
            except OSError:
                return

    reader = threading.Thread(target=trickle, daemon=True)
    reader.start()
    try:
        payload = np.frombuffer(payload_for(0) * 64, np.uint8)  # 1 MiB
        started = time.monotonic()
        with pytest.raises(TimeoutError, match=r"budget of 0\.5 s"):
            _core.send_all(ours.fileno(), [payload], TIMEOUT_S, 0.5)
        assert time.monotonic() - started < 0.5 + MARGIN_S
        deadline = time.monotonic() + WAIT_S
        while not taken[0]:  # it was taking bytes all along (each wait for room was short)
            assert time.monotonic() < deadline
            time.sleep(TRICKLE_S)
        assert taken[0] < payload.nbytes
    finally:
        stop.set()
        ours.close()
        theirs.close()
        reader.join(WAIT_S)
