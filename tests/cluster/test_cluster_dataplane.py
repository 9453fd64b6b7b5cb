"""The TCP data plane and leases: real sockets on 127.0.0.x, real HostPools holding random bits
of many dtypes, real threads. Every server is closed by its ``with`` block."""

from __future__ import annotations

import contextlib
import json
import select
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync._src.cluster.dataplane import Served, wire
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.cluster.dataplane.frames import (
    LOCAL_SEND_BUFFER_BYTES,
    send_buffers,
    tune_for_peer,
)
from tpusync._src.cluster.dataplane.protocol import DEADLINE_FRACTION
from tpusync._src.testing.polling import eventually
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    LeaseTable,
    PeerCircuits,
    RemotePool,
)
from tpusync.errors import (
    AuthenticationError,
    BlocksMissingError,
    InvalidArgumentError,
    PeerUnavailableError,
    RemoteOperationUnsupportedError,
    TierFullError,
)
from tpusync.tiers import ArrayLayout, HostPool, LowerTier, PoolLayout

SECRET = b"s" * 32
OTHER_SECRET = b"o" * 32
CAPACITY = 32

# One block spans arrays of many dtypes, shapes, block axes and shard counts; its payload is
# not a multiple of a page (the slot is, so every block is followed by slack bytes).
LAYOUT = PoolLayout(
    "dataplane-test",
    (
        ArrayLayout("f32", "float32", (3, 33), 0, 1),
        ArrayLayout("bf16", "bfloat16", (2, 4, 17), 1, 2),
        ArrayLayout("f16", "float16", (5, 7), 0, 1),
        ArrayLayout("i8", "int8", (7,), 0, 1),
        ArrayLayout("u16", "uint16", (2, 9), 0, 1),
        ArrayLayout("fp8", str(np.dtype(ml_dtypes.float8_e4m3fn)), (3, 5), 0, 1),
        ArrayLayout("b", "bool", (11,), 0, 1),
        ArrayLayout("i64", "int64", (2, 3), 1, 1),
    ),
)


def key_for(i: int) -> bytes:
    return b"block-" + i.to_bytes(4, "little")


def fill(pool: HostPool, keys: list[bytes], rng: np.random.Generator, arrays: Any) -> None:
    """Stores random bits under ``keys`` in ``pool``, array by array through the layout's views
    of each slot, committed with their checksums."""
    reservation = pool.reserve(keys)
    for slot in reservation.slots.tolist():
        with pool.slot_memory(slot) as memory:
            for i, array in enumerate(pool.layout.arrays):
                view = pool.layout.host_view(memory, i, 1)
                view[...] = arrays.random(rng, view.shape, array.np_dtype)
                del view
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def payload(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None, f"{key!r} is not committed"
    with pool.slot_memory(slot) as memory:
        return bytes(memory[: pool.layout.payload_bytes])


def assert_clean(pool: HostPool, used: int) -> None:
    """No slot leaked in the writing state: exactly ``used`` committed, the rest free."""
    assert pool.used == used
    assert pool.free == pool.capacity - used


def assert_unpinned(server: BlockServer, keys: list[bytes]) -> None:
    """The server holds no lease and no pin: every key can be deleted."""
    assert len(server.leases) == 0
    present = server.pool.contains(keys)
    assert server.pool.delete(keys) == sum(present)


def assert_stops_at_deadline(client: BlockClient, keys: list[bytes], target: HostPool) -> int:
    """Pulls six blocks from a server that takes 0.3 s a block and refuses renewals, under a
    1 s lease: the pull stops at its deadline, keeps a completed prefix, reports the timeout and
    leaks no slot. Returns how many blocks it kept."""
    start = time.monotonic()
    result = client.pull_result(keys, target)
    assert time.monotonic() - start < 1.5  # not the 1.8 s all six blocks take
    done = sum(result.loaded)
    assert done < 6 and result.loaded == [True] * done + [False] * (6 - done)
    assert isinstance(result.error, TimeoutError)
    assert_clean(target, done)
    return done


def slow_server(delay_s: float, *, renews: bool = True) -> type[BlockServer]:
    """A BlockServer that waits ``delay_s`` (real time) before each block; with ``renews=False``
    it refuses every lease renewal."""

    class Slow(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            # Time passes on purpose, not to wait for anything: the client's pull deadline and
            # its lease renewals run on the real monotonic clock (BlockClient takes no clock).
            time.sleep(delay_s)
            super()._send_block(conn, header, data)

        def _renew(self, served: Served, params: dict[str, Any]) -> bool:
            return renews and super()._renew(served, params)

    return Slow


class RenewalGate:
    """A BlockServer class (``server``) that holds the ``last``-th block it sends until it has
    granted ``renewals`` lease renewals, and records when it sent that block: a pull that
    outlives its first deadline by events, not by sleeps, so its margins hold on a loaded
    machine (issue 54). Renewals still come on the client's real clock (a third of the TTL)."""

    def __init__(self, last: int, renewals: int) -> None:
        self.granted: list[float] = []  # when each renewal was granted
        self.last_sent_at: float | None = None
        self._sent = 0
        self._enough = threading.Event()
        self._lock = threading.Lock()
        gate = self

        class Gated(BlockServer):
            def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
                with gate._lock:
                    gate._sent += 1
                    is_last = gate._sent == last
                if is_last:
                    gate._enough.wait(timeout=60)  # a failed pull fails the test, not a hang
                    gate.last_sent_at = time.monotonic()
                super()._send_block(conn, header, data)

            def _renew(self, served: Served, params: dict[str, Any]) -> bool:
                granted = super()._renew(served, params)
                if granted:
                    with gate._lock:
                        gate.granted.append(time.monotonic())
                        if len(gate.granted) >= renewals:
                            gate._enough.set()
                return granted

        self.server = Gated


@pytest.fixture
def source(rng: np.random.Generator, arrays: Any) -> Iterator[HostPool]:
    with HostPool(LAYOUT, CAPACITY) as pool:
        fill(pool, [key_for(i) for i in range(24)], rng, arrays)
        yield pool


@pytest.fixture
def target() -> Iterator[HostPool]:
    with HostPool(LAYOUT, CAPACITY) as pool:
        yield pool


def client_for(server: BlockServer, **kwargs: Any) -> BlockClient:
    kwargs.setdefault("secret", SECRET)
    kwargs.setdefault("timeout_s", 5.0)
    if "addresses" not in kwargs:
        kwargs["address"] = server.address
    return BlockClient(**kwargs)


# -- round trips -----------------------------------------------------------------------------


def test_pull_round_trip_bit_exact(source: HostPool, target: HostPool) -> None:
    keys = [key_for(i) for i in range(16)]
    with BlockServer(source, secret=SECRET) as server, client_for(server) as client:
        result = client.pull_result(keys, target)
        assert result.loaded == [True] * 16 and result.released and result.corrupt == 0
        assert result.bytes_received == 16 * LAYOUT.payload_bytes
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert_clean(target, 16)
        # Held keys count as loaded and move nothing; repeated keys get the same answer.
        again = client.pull_result([keys[0], keys[0], key_for(16)], target)
        assert again.loaded == [True, True, True] and again.bytes_received == LAYOUT.payload_bytes
        assert payload(target, key_for(16)) == payload(source, key_for(16))
        assert client.contains([keys[3], b"absent"]) == [True, False]
        assert client.stat() == {"capacity": CAPACITY, "used": 24}
        assert_unpinned(server, [key_for(i) for i in range(24)])


def test_missing_keys_come_back_false(source: HostPool, target: HostPool) -> None:
    keys = [key_for(0), b"absent-1", key_for(5), b"absent-2", key_for(7)]
    with BlockServer(source, secret=SECRET) as server, client_for(server) as client:
        assert client.pull(keys, target) == [True, False, True, False, True]
        assert_clean(target, 3)
        assert target.contains([b"absent-1", b"absent-2"]) == [False, False]
        assert_unpinned(server, [key_for(i) for i in range(24)])


def test_striping_over_three_connections_and_two_local_addresses(
    source: HostPool, target: HostPool
) -> None:
    peers: list[tuple[str, int]] = []

    class Recording(BlockServer):
        def _handle_get(self, conn: socket.socket, served: Served, rid: int, params: dict) -> bool:
            peers.append((conn.getpeername()[0], len(params["keys"])))
            return super()._handle_get(conn, served, rid, params)

    keys = [key_for(i) for i in range(20)]
    with Recording(source, secret=SECRET) as server:
        paths = [f"127.0.0.1>{server.address}", f"127.0.0.2>{server.address}"]
        with client_for(server, addresses=paths, connections=3) as client:
            assert client.pull(keys, target) == [True] * 20
    for key in keys:
        assert payload(target, key) == payload(source, key)
    # Keys dealt round robin: connections 0 and 2 on path 0 (127.0.0.1), connection 1 on path 1.
    assert sorted(peers) == [("127.0.0.1", 6), ("127.0.0.1", 7), ("127.0.0.2", 7)]
    assert_clean(target, 20)


def test_connections_within_this_host_send_through_a_small_buffer(
    source: HostPool, target: HostPool
) -> None:
    """Over loopback each end's send buffer is sized (Linux doubles the size asked for)
    instead of autotuned: the server's (it sends pulls) and the client's (it sends pushes)."""
    with open("/proc/sys/net/core/wmem_max") as f:  # what SO_SNDBUF is capped at
        small = 2 * min(LOCAL_SEND_BUFFER_BYTES, int(f.read()))
    with BlockServer(source, secret=SECRET) as server, client_for(server, connections=2) as client:
        assert client.pull([key_for(i) for i in range(4)], target) == [True] * 4
        with server._lock:
            served = list(server._conns)
        assert len(served) >= 2  # a connection per stripe
        assert {c.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) for c in served} == {small}
        for conn in client._conns:
            assert conn.sock is not None
            assert conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == small


class _PeerOnAnotherHost:
    """Stands in for a socket connected to another host (this machine has no second one)."""

    def __init__(self, local: str, peer: str) -> None:
        self.local, self.peer = local, peer
        self.options: list[tuple[int, int, int]] = []

    def getsockname(self) -> tuple[str, int]:
        return (self.local, 40000)

    def getpeername(self) -> tuple[str, int]:
        return (self.peer, 7000)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))


def test_only_peers_on_this_host_get_the_small_send_buffer() -> None:
    for local, peer in (("10.1.0.1", "10.1.0.2"), ("::ffff:10.1.0.1", "::ffff:10.1.0.2")):
        far = _PeerOnAnotherHost(local, peer)
        tune_for_peer(far)  # type: ignore[arg-type]
        assert far.options == []  # left to autotuning: a fixed buffer caps buffer / RTT
    for local, peer in (
        ("10.1.0.1", "10.1.0.1"),
        ("127.0.0.1", "127.0.0.5"),
        ("::1", "::1"),
        ("::ffff:10.1.0.1", "::ffff:127.0.0.2"),
    ):
        near = _PeerOnAnotherHost(local, peer)
        tune_for_peer(near)  # type: ignore[arg-type]
        assert near.options == [(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SEND_BUFFER_BYTES)]
    a, b = socket.socketpair()  # not an IP socket: nothing to tune, no error
    with a, b:
        tune_for_peer(a)


def test_remote_pool_is_the_read_side_of_a_lower_tier(source: HostPool, target: HostPool) -> None:
    with BlockServer(source, secret=SECRET) as server:
        with RemotePool(client_for(server), LAYOUT) as remote:
            assert isinstance(remote, LowerTier)
            assert (remote.capacity, remote.used) == (CAPACITY, 24)
            remote.get([key_for(1), key_for(2)], target)
            with pytest.raises(BlocksMissingError) as info:
                remote.get([key_for(3), b"absent"], target)
            assert info.value.loaded == [True, False] and info.value.corrupt == 0
            assert remote.contains([key_for(3), b"absent"]) == [True, False]
            assert remote.stats.hits == 3 and remote.stats.misses == 1
            with pytest.raises(RemoteOperationUnsupportedError):
                remote.put([key_for(1)], target)
            with pytest.raises(NotImplementedError):
                remote.delete([key_for(1)])
            with pytest.raises(RemoteOperationUnsupportedError):
                remote.keys()
        with client_for(server) as client:
            other = PoolLayout("another-model", LAYOUT.arrays)
            with pytest.raises(InvalidArgumentError, match="another block layout"):
                RemotePool(client, other)
            with HostPool(other, 4) as wrong, pytest.raises(InvalidArgumentError, match="target"):
                client.pull([key_for(1)], wrong)
            with HostPool(LAYOUT, 2) as small, pytest.raises(TierFullError):
                client.pull([key_for(i) for i in range(3)], small)
    assert_clean(target, 3)


# -- authentication --------------------------------------------------------------------------


def test_wrong_secret_is_rejected_both_ways(source: HostPool) -> None:
    with BlockServer(source, secret=SECRET) as server:
        with pytest.raises(AuthenticationError, match="rejected"):
            client_for(server, secret=OTHER_SECRET)
        eventually(lambda: server.rejected == 1)  # counted just after the refusal is sent
        # An unauthenticated peer asking for blocks gets the handshake and a refusal, no block.
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            lease = json.dumps({"id": 1, "method": "acquire", "params": {"keys": ["00"]}})
            get = json.dumps({"id": 2, "method": "get", "params": {"lease": 1, "keys": ["00"]}})
            for text in (lease, get):
                raw.sendall(struct.pack(">I", len(text)) + text.encode())
            received = _read_all(raw)
        assert b"authentication failed" in received
        assert wire.MAGIC not in received and b'"lease"' not in received
        assert len(server.leases) == 0
    # A server that does not know the secret: the client refuses it.
    with _impostor_server() as address, pytest.raises(AuthenticationError, match="impostor"):
        BlockClient(address, secret=SECRET, timeout_s=5)


def closed_by_peer(sock: socket.socket | None) -> bool:
    """Whether the other end closed ``sock``, without waiting: anything it sent before is read
    and dropped (the connection is over either way)."""
    if sock is None:
        return True
    while select.select([sock], [], [], 0)[0]:
        try:
            if not sock.recv(65536, socket.MSG_DONTWAIT):
                return True
        except BlockingIOError:
            return False
        except OSError:  # reset
            return True
    return False


def _read_all(sock: socket.socket) -> bytes:
    out = bytearray()
    with contextlib.suppress(OSError):
        while chunk := sock.recv(65536):
            out += chunk
    return bytes(out)


@contextlib.contextmanager
def _impostor_server() -> Iterator[str]:
    """A listener that speaks the handshake but answers with a MAC made without the secret."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = listener.accept()
            with conn:
                hello = {"hello": "tpusync-registry", "version": 1, "nonce": "ab" * 32}
                _send(conn, hello)
                conn.recv(4096)
                _send(conn, {"mac": "00" * 32})
                conn.recv(4096)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
        thread.join(timeout=5)


def _send(sock: socket.socket, obj: Any) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def test_unreachable_server_and_mismatched_paths(source: HostPool) -> None:
    with socket.create_server(("127.0.0.1", 0)) as placeholder:
        port = placeholder.getsockname()[1]
    with pytest.raises(PeerUnavailableError):
        BlockClient(f"127.0.0.1:{port}", secret=SECRET, timeout_s=2)
    with (
        BlockServer(source, secret=SECRET) as one,
        BlockServer(source, secret=SECRET) as two,
        pytest.raises(InvalidArgumentError, match="another block server"),
    ):
        BlockClient(addresses=[one.address, two.address], secret=SECRET, timeout_s=5)
    with pytest.raises(InvalidArgumentError):
        BlockClient(secret=SECRET)
    with pytest.raises(InvalidArgumentError):
        BlockClient("127.0.0.1:1", secret=b"short")


def test_a_connection_closed_by_another_thread_never_connects_behind_it() -> None:
    """close() on another thread can land between a caller's check that the connection is open
    and its connect (a pull's deadline closing a client whose lease renewal reconnects): that
    connect fails at once instead of waiting out the timeout on a server that never answers."""
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never speaks
        conn = Connection(None, silent.getsockname(), "silent", SECRET, timeout=10.0)
        conn.close()
        start = time.monotonic()
        with pytest.raises(PeerUnavailableError, match="closed while connecting"):
            conn.connect()
        assert time.monotonic() - start < 2
        assert conn.sock is None

        waiting = Connection(None, silent.getsockname(), "silent", SECRET, timeout=10.0)
        failed: list[BaseException] = []

        def connect() -> None:
            try:
                waiting.connect()
            except PeerUnavailableError as exc:
                failed.append(exc)

        thread = threading.Thread(target=connect)
        thread.start()
        silent.settimeout(5)
        accepted, _ = silent.accept()  # connected; its handshake waits (or is about to)
        start = time.monotonic()
        waiting.close()  # mid-handshake, or just before: either way the connect ends now
        thread.join(timeout=5)
        accepted.close()
        assert not thread.is_alive() and len(failed) == 1
        assert time.monotonic() - start < 2


# -- damaged transfers -----------------------------------------------------------------------


def test_corrupted_payload_byte_is_not_committed(source: HostPool, target: HostPool) -> None:
    victim = key_for(4)

    class Corrupting(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            if wire.decode_header(header, max_payload=1 << 30).key == victim:
                damaged = bytearray(data)
                damaged[len(damaged) // 3] ^= 0x10
                data = memoryview(damaged)
            super()._send_block(conn, header, data)

    keys = [key_for(i) for i in range(8)]
    with Corrupting(source, secret=SECRET) as server, client_for(server) as client:
        result = client.pull_result(keys, target)
        assert result.loaded == [k != victim for k in keys]
        assert result.corrupt == 1 and result.released
        assert_clean(target, 7)
        assert not target.contains([victim])[0]
        with RemotePool(client, LAYOUT, owns_client=False) as remote:
            with pytest.raises(BlocksMissingError) as info:
                remote.get([victim], target)
            assert info.value.loaded == [False] and info.value.corrupt == 1
        assert_unpinned(server, keys)


@pytest.mark.parametrize("cut_at", [0, 3])
def test_connection_cut_mid_block(source: HostPool, target: HostPool, cut_at: int) -> None:
    sent = [0]
    client_went_on = threading.Event()

    class Cutting(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            if sent[0] == cut_at:
                sent[0] += 1
                send_buffers(conn, [header, data[: len(data) // 2]])
                conn.shutdown(socket.SHUT_RDWR)
                # the client sees the cut and goes on before this thread unwinds
                assert client_went_on.wait(10), "the client never came back from the cut pull"
                raise ConnectionResetError("cut by the test")
            sent[0] += 1
            super()._send_block(conn, header, data)

    keys = [key_for(i) for i in range(8)]
    with Cutting(source, secret=SECRET) as server, client_for(server) as client:
        result = client.pull_result(keys, target)
        client_went_on.set()
        assert result.loaded == [i < cut_at for i in range(8)]
        assert isinstance(result.error, EOFError | OSError)
        assert_clean(target, cut_at)  # the half block's slot went back to the free list
        for key in keys[:cut_at]:
            assert payload(target, key) == payload(source, key)
        # The client re-connects; the same keys can be reserved and pulled again.
        assert client.pull(keys, target) == [True] * 8
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert_clean(target, 8)
        # The cut get's pins go when its server thread unwinds, which the client does not wait
        # for (it saw the cut first and went on): eventually, not at once.
        assert len(server.leases) == 0
        deleted = [0]

        def all_deletable() -> bool:
            deleted[0] += server.pool.delete(keys)
            return deleted[0] == len(keys)

        eventually(all_deletable)


def test_lease_expired_during_a_slow_pull_commits_nothing(
    source: HostPool, target: HostPool
) -> None:
    """The server's lease clock passes the TTL while the blocks are on their way (a pull slower
    than its lease): the release answers False and the client keeps nothing."""
    now = [1000.0]

    class Slow(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            now[0] += 60.0  # longer than the lease
            super()._send_block(conn, header, data)

    keys = [key_for(i) for i in range(6)]
    with (
        Slow(source, secret=SECRET, lease_ttl_s=10.0, clock=lambda: now[0]) as server,
        client_for(server) as client,
    ):
        result = client.pull_result(keys, target)
        assert result.loaded == [False] * 6
        assert not result.released and result.corrupt == 0
        assert result.bytes_received == 6 * LAYOUT.payload_bytes  # all arrived, none kept
        assert_clean(target, 0)
        assert server.leases.expired == 1
        assert_unpinned(server, keys)


def test_pull_stops_at_its_deadline_before_the_lease_ends(
    source: HostPool, target: HostPool
) -> None:
    """Real time: a server that sends a block every 0.3 s under a 1 s lease and refuses to
    renew it. The client stops receiving after 0.8 s (DEADLINE_FRACTION of the TTL), releases in
    time and keeps only the blocks it completed."""

    slow = slow_server(0.3, renews=False)
    keys = [key_for(i) for i in range(6)]
    with slow(source, secret=SECRET, lease_ttl_s=1.0) as server, client_for(server) as client:
        done = assert_stops_at_deadline(client, keys, target)
        for key in keys[:done]:
            assert payload(target, key) == payload(source, key)


def test_a_pull_longer_than_its_lease_renews_it(source: HostPool, target: HostPool) -> None:
    """8 blocks under a 2 s lease (the pull's first deadline: 1.6 s), the last sent only once
    the server has granted three renewals, so the pull outlives its first deadline: the client
    renews the lease every third of its TTL over its control connection, receives everything,
    and the lease was held the whole time. The margin for a renewal's round trip is about 0.9 s
    (the last renewal's deadline minus the next renewal's time)."""
    gate = RenewalGate(last=8, renewals=3)
    keys = [key_for(i) for i in range(8)]
    with (
        gate.server(source, secret=SECRET, lease_ttl_s=2.0) as server,
        client_for(server) as client,
    ):
        start = time.monotonic()
        result = client.pull_result(keys, target)
        assert result.loaded == [True] * 8 and result.released and result.error is None
        assert len(gate.granted) >= 3 and gate.last_sent_at is not None
        assert gate.last_sent_at - start > 2.0 * DEADLINE_FRACTION  # past the first deadline
        assert server.leases.expired == 0
        for key in keys:
            assert payload(target, key) == payload(source, key)
        assert_unpinned(server, keys)


def test_idle_connections_closed_by_the_server_are_remade(
    source: HostPool, target: HostPool
) -> None:
    with (
        BlockServer(source, secret=SECRET, io_timeout_s=0.2) as server,
        client_for(server, addresses=[server.address], connections=2) as client,
    ):
        assert client.pull([key_for(0), key_for(1)], target) == [True, True]
        # the server closes both idle connections
        eventually(lambda: all(closed_by_peer(conn.sock) for conn in client._conns))
        assert client.pull([key_for(i) for i in range(2, 6)], target) == [True] * 4
        assert client.contains([key_for(0)]) == [True]
    assert_clean(target, 6)


# -- hostile input ---------------------------------------------------------------------------


def test_garbage_to_the_server_is_survived(source: HostPool, target: HostPool) -> None:
    rng = np.random.default_rng(7)
    with BlockServer(source, secret=SECRET, handshake_timeout_s=2) as server:
        garbage = [
            rng.integers(0, 256, 5000, dtype=np.uint8).tobytes(),
            b"\xff\xff\xff\xff" + b"x" * 100,  # a 4 GiB frame announced
            struct.pack(">I", 10) + b"not json!!",
            struct.pack(">I", 4) + b"[1]\n",
            b"",
        ]
        for data in garbage:
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
                with contextlib.suppress(OSError):  # the server may have hung up already
                    raw.sendall(data)
                    raw.shutdown(socket.SHUT_WR)
                assert wire.MAGIC not in _read_all(raw)
        # Authenticated, then nonsense: bad requests are answered, broken streams closed.
        with client_for(server) as client:
            conn = client._conns[0]
            assert conn.sock is not None
            bad = [
                {"id": 1, "method": "nope"},
                {"id": "x", "method": "acquire", "params": {}},
                {"id": 2, "method": "acquire", "params": {"keys": ["zz"]}},
                {"id": 3, "method": "acquire", "params": {"keys": [], "ttl_s": -1}},
                {"id": 4, "method": "release", "params": {"lease": "x"}},
            ]
            for request in bad:
                _send(conn.sock, request)
                length = struct.unpack(">I", conn.sock.recv(4))[0]
                answer = json.loads(conn.sock.recv(length))
                assert "error" in answer
            _send(conn.sock, {"id": 5, "method": "get", "params": {"lease": 9, "keys": ["00"]}})
            header = wire.decode_header(conn.sock.recv(wire.HEADER_SIZE), max_payload=4096)
            assert header.frame_type == wire.ERROR and header.request_id == 5
            assert b"lease" in conn.sock.recv(header.payload_length)
            conn.sock.sendall(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
            eventually(lambda: closed_by_peer(conn.sock))  # the server drops the broken stream
            keys = [key_for(i) for i in range(5)]
            assert client.pull(keys, target) == [True] * 5  # re-connected
        # Still serving a fresh, proper client.
        with client_for(server) as client:
            assert client.pull([key_for(9)], target) == [True]
        assert len(server.leases) == 0
    assert_clean(target, 6)


def test_client_parser_survives_random_frames(source: HostPool) -> None:
    """The server's answer to ``get`` is replaced by hypothesis-drawn bytes: random ones, or a
    correct answer with bytes changed, cut short or frames reordered. The client never raises,
    and commits exactly the blocks whose frames (and the headers before them) arrived unchanged:
    every change breaks a CRC, a checksum or the framing."""
    plan: dict[str, Any] = {}
    keys = [key_for(i) for i in range(3)]

    class Scripted(BlockServer):
        def _handle_get(self, conn: socket.socket, served: Served, rid: int, params: dict) -> bool:
            fp = self.pool.layout.fingerprint
            frames = []
            for key in [bytes.fromhex(k) for k in params["keys"]]:
                pinned = self.pool.pin([key])
                try:
                    size = self.pool.layout.payload_bytes
                    header = wire.encode_header(
                        wire.BLOCK, rid, key, fp, size, int(pinned.checksums[0])
                    )
                    with self.pool.slot_memory(int(pinned.slots[0])) as memory:
                        frames.append(header + bytes(memory[:size]))
                finally:
                    self.pool.unpin(pinned)
            frames.append(wire.encode_header(wire.END, rid, b"", fp))
            if plan["reorder"]:
                frames[0], frames[1] = frames[1], frames[0]
            original = b"".join(frames)
            data = bytearray(original)
            for position, flip in plan["flips"]:
                data[position % len(data)] ^= flip
            if plan["cut"] is not None:
                del data[plan["cut"] % len(data) :]
            if plan["random"] is not None:
                data = bytearray(plan["random"])
            # A block may arrive only if its frame and the headers before it went out unchanged
            # (a damaged payload fails its own checksum but leaves the framing intact).
            starts = np.cumsum([0] + [len(frame) for frame in frames]).tolist()
            for j, key in enumerate(bytes.fromhex(k) for k in params["keys"]):
                spans = [(starts[i], starts[i] + wire.HEADER_SIZE) for i in range(j)]
                spans.append((starts[j], starts[j + 1]))
                plan["intact"][key] = not plan["reorder"] and all(
                    data[a:b] == original[a:b] for a, b in spans
                )
            with contextlib.suppress(OSError):
                conn.sendall(data)
            return False  # close the connection

    with (
        HostPool(LAYOUT, 8) as target,
        Scripted(source, secret=SECRET) as server,
        # the parser is under test, not the back-off: a circuit that never opens on damage
        client_for(server, timeout_s=2, circuits=PeerCircuits(threshold=1 << 30)) as client,
    ):

        @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(
            st.fixed_dictionaries(
                {
                    "flips": st.lists(
                        st.tuples(st.integers(0, 1 << 20), st.integers(1, 255)), max_size=3
                    ),
                    "cut": st.none() | st.integers(0, 1 << 20),
                    "random": st.none() | st.binary(max_size=400),
                    "reorder": st.booleans(),
                }
            )
        )
        def run(drawn: dict[str, Any]) -> None:
            if not drawn["flips"] and drawn["cut"] is None and not drawn["reorder"]:
                drawn["random"] = drawn["random"] or b""
            plan.update(drawn)
            plan["intact"] = {}
            target.delete(keys)  # a failed example must not leave blocks for the next one
            result = client.pull_result(keys, target)
            intact = [plan["intact"][key] for key in keys]
            assert result.loaded == intact
            if not all(intact):
                assert result.error is not None or result.corrupt > 0
            for key in [k for k, ok in zip(keys, intact, strict=True) if ok]:
                assert payload(target, key) == payload(source, key)
            assert_clean(target, sum(intact))

        run()
        assert len(server.leases) == 0
    assert_unpinned(server, keys)


# -- leases ----------------------------------------------------------------------------------


def test_lease_table_pins_renews_releases_and_expires(source: HostPool) -> None:
    now = [0.0]
    keys = [key_for(0), key_for(1), b"absent"]
    with LeaseTable(source, clock=lambda: now[0]) as table:
        lease = table.acquire(keys, ttl_s=10)
        assert lease.present == [True, True, False]
        assert lease.checksums[2] == 0 and lease.checksums[0] != 0
        assert source.delete(keys) == 0  # pinned: nothing deleted
        now[0] = 9.0
        assert table.renew(lease.lease_id, 10)
        now[0] = 18.0
        assert table.lookup(lease.lease_id) == lease
        assert table.release(lease.lease_id)  # held the whole time
        assert not table.release(lease.lease_id)  # once only
        assert not table.renew(lease.lease_id, 10)

        late = table.acquire(keys, ttl_s=5)
        now[0] = 23.5
        assert table.lookup(late.lease_id) is None and table.expired == 1
        assert not table.release(late.lease_id)  # expired: the reader must discard
        assert source.delete([key_for(0)]) == 1  # expiry unpinned it

        held = table.acquire([key_for(1)], ttl_s=5)
        with pytest.raises(InvalidArgumentError):
            table.acquire(keys, ttl_s=0)
        with pytest.raises(InvalidArgumentError):
            table.acquire([b""], ttl_s=1)
        assert len(table) == 1 and held.present == [True]
    assert source.delete([key_for(1)]) == 1  # close() released the last lease


def test_lease_expiry_thread_unpins_without_calls(source: HostPool) -> None:
    with LeaseTable(source) as table:
        lease = table.acquire([key_for(2)], ttl_s=0.05)
        assert source.delete([key_for(2)]) == 0
        # The thread unpins it: no table call in between.
        eventually(lambda: source.delete([key_for(2)]) == 1)
        assert not table.release(lease.lease_id)


def test_native_receive_fills_the_buffer_times_out_and_sees_eof(rng: np.random.Generator) -> None:
    """_core.recv_exact: a payload sent in pieces arrives whole in one call; silence longer than
    the timeout returns what came so far; a closed peer is EOFError; works on a socket in
    Python's timeout (non-blocking) mode."""
    from tpusync._native import core as _core

    data = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    try:
        b.settimeout(5.0)  # non-blocking at the OS level, as every data-plane socket is

        def send() -> None:
            for i in range(0, len(data), 100_000):
                a.sendall(data[i : i + 100_000])

        sender = threading.Thread(target=send)
        sender.start()
        buffer = bytearray(len(data))
        assert _core.recv_exact(b.fileno(), buffer, 5.0) == len(data)
        sender.join(5)
        assert bytes(buffer) == data
        a.sendall(b"xyz")
        start = time.monotonic()
        short = bytearray(10)
        assert _core.recv_exact(b.fileno(), short, 0.2) == 3  # then 0.2 s of silence
        assert 0.15 < time.monotonic() - start < 2 and bytes(short[:3]) == b"xyz"
        a.close()
        with pytest.raises(EOFError):
            _core.recv_exact(b.fileno(), bytearray(4), 1.0)
    finally:
        a.close()
        b.close()
