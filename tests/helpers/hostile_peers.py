"""Hostile peers and the servers they attack, shared by the tests that prove no peer stops a
tpusync server (tests/cluster/test_server_loops.py) and the soak under them
(tests/cluster/test_soak_hostile_peers.py).

``serving(kind, ...)`` runs one server kind with a legitimate ``visit`` that checks every byte it
pulls; the behaviours in ``HOSTILE`` are what one hostile peer does to a server once; ``holdings``
and ``back_to`` count this process's threads and descriptors.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from preauth_child import LAYOUT, key_for, payload_for
from tools import self_signed_tls

from tpusync._src.cluster._handshake import client_handshake
from tpusync._src.weights.manifest import chunk_key, chunk_layout
from tpusync.cluster import (
    BlockClient,
    MemoryRegistry,
    NodeInfo,
    RegistryServer,
    RemoteRegistry,
    StoreNode,
    StoreNodePool,
)
from tpusync.tiers import HostPool
from tpusync.weights import Publisher, WeightsPoolOptions

SECRET = bytes(range(100, 132))
HANDSHAKE_S = 2.0  # a registry's handshake deadline here: stalled peers are dropped after it
WAIT_S = 30.0  # the longest wait for anything (a generous margin, not a measurement)
CHUNK = 4096
KINDS = ["store", "registry", "publisher", "registry-tls"]


# -- servers and their legitimate clients ---------------------------------------------------------


@dataclass
class Served:
    """A running server of one kind: where it listens, its server object, the TLS context a
    client needs (or None), and one legitimate visit (connect, authenticate, do real work,
    check the bytes)."""

    kind: str
    address: str
    server: Any
    client_tls: ssl.SSLContext | None
    visit: Callable[[int], None]


def _payload(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None
    with pool.slot_memory(slot) as memory:
        return bytes(memory[: pool.layout.payload_bytes])


@dataclass(frozen=True)
class Tls:
    """A self-signed certificate for 127.0.0.1: the server's context, a client context that
    trusts it, and the certificate's file (what --tls-ca takes)."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    ca: Path


@contextlib.contextmanager
def serving(kind: str, source: HostPool, names: Callable[[], str], tls: Tls) -> Iterator[Served]:
    """A server of ``kind`` (see KINDS); a registry's handshake deadline is HANDSHAKE_S (the
    others keep theirs: the peers that stall are closed by the test)."""
    if kind == "store":  # what `tpusync serve --registry-port 0` runs
        node = StoreNode(4 << 20, secret=SECRET, registry_port=0)

        def visit_store(i: int) -> None:
            keys = [key_for(i % 4)]
            with (
                StoreNodePool(node.address, layout=LAYOUT, secret=SECRET, timeout_s=WAIT_S) as to,
                HostPool(LAYOUT, 1) as target,
            ):
                assert to.put(keys, source) == 1
                to.get(keys, target)
                assert _payload(target, keys[0]) == payload_for(i % 4)
                assert to.delete(keys) == 1

        with node:
            yield Served(kind, node.address, node.server, None, visit_store)
        return
    if kind.startswith("registry"):
        server_tls, client_tls = (tls.server, tls.client) if kind.endswith("tls") else (None, None)
        with RegistryServer(
            MemoryRegistry(), secret=SECRET, tls=server_tls, handshake_timeout_s=HANDSHAKE_S
        ) as server:

            def visit_registry(i: int) -> None:
                with RemoteRegistry(
                    server.address, secret=SECRET, tls=client_tls, timeout_s=WAIT_S
                ) as registry:
                    node_id = f"legit-{i}"
                    registry.register(NodeInfo(node_id), 30)
                    registry.publish(node_id, [key_for(i)], "dram")
                    held = registry.holders([key_for(i)])[0]
                    assert node_id in {h.node_id for h in held}
                    registry.unregister(node_id)

            yield Served(kind, server.address, server, client_tls, visit_registry)
        return
    assert kind == "publisher"
    name = names()
    weights = np.random.default_rng(53).integers(0, 256, 3 * CHUNK, dtype=np.uint8)
    pool = WeightsPoolOptions(chunk_bytes=CHUNK, capacity_bytes=16 * CHUNK)
    with Publisher(name, secret=SECRET, pool=pool) as pub:
        pub.publish({"w": weights}, 1)
        assert pub.server is not None
        address = pub.address
        assert address is not None

        def visit_publisher(i: int) -> None:
            key = chunk_key(name, 1, i % 3)
            with (
                BlockClient(address, secret=SECRET, timeout_s=WAIT_S) as client,
                HostPool(chunk_layout(name, CHUNK), 1) as target,
            ):
                assert client.pull([key], target) == [True]
                start = (i % 3) * CHUNK
                assert _payload(target, key) == weights[start : start + CHUNK].tobytes()

        yield Served(kind, address, pub.server, None, visit_publisher)


# -- counting what the process holds -------------------------------------------------------------


def holdings() -> tuple[int, int]:
    """(threads, open descriptors) of this process, from /proc."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def back_to(baseline: tuple[int, int], within: float = WAIT_S) -> tuple[int, int]:
    """Waits (polling, at most ``within`` s) until the threads and descriptors are no more
    than ``baseline``; returns the last count."""
    deadline = time.monotonic() + within
    while True:
        now = holdings()
        if (now[0] <= baseline[0] and now[1] <= baseline[1]) or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


# -- hostile peers -------------------------------------------------------------------------------


def _address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _reset(sock: socket.socket) -> None:
    """Closes ``sock`` with a reset (SO_LINGER 0): the server's next send or receive fails."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


class Peer:
    """One hostile connection to a server (through TLS when the server serves it)."""

    def __init__(self, served: Served) -> None:
        raw = socket.create_connection(_address(served.address), timeout=WAIT_S)
        self.sock: socket.socket = raw
        if served.client_tls is not None:
            self.sock = served.client_tls.wrap_socket(raw, server_hostname="127.0.0.1")

    def hello(self) -> None:
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        _recv_exact(self.sock, n)

    def authenticate(self) -> None:
        client_handshake(self.sock, SECRET, "the server under test")

    def wait_closed(self) -> None:
        """Reads until the server closes (its deadline is HANDSHAKE_S; WAIT_S is the margin)."""
        with contextlib.suppress(OSError, ssl.SSLError):
            while self.sock.recv(4096):
                pass

    def reset(self) -> None:
        _reset(self.sock)

    def close(self) -> None:
        self.sock.close()


def reset_at_once(served: Served, stalled: list[Peer]) -> None:
    _reset(socket.create_connection(_address(served.address), timeout=WAIT_S))


def reset_mid_tls_or_hello(served: Served, stalled: list[Peer]) -> None:
    raw = socket.create_connection(_address(served.address), timeout=WAIT_S)
    if served.client_tls is not None:
        raw.sendall(b"\x16\x03\x01\x02\x00" + os.urandom(40))  # half a ClientHello
    _reset(raw)


def reset_mid_handshake(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    peer.hello()
    peer.sock.sendall(struct.pack(">I", 150) + b'{"nonce": "')  # half a proof
    peer.reset()


def reset_after_a_wrong_proof(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    peer.hello()
    proof = {"nonce": os.urandom(32).hex(), "mac": os.urandom(32).hex()}
    peer.sock.sendall(_frame(json.dumps(proof).encode()))
    peer.reset()  # the server's refusal meets a reset


def reset_once_authenticated(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    peer.authenticate()
    peer.reset()


def half_close_at_once(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    peer.sock.shutdown(socket.SHUT_WR)
    peer.wait_closed()
    peer.close()


def half_close_mid_handshake(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    peer.hello()
    peer.sock.sendall(struct.pack(">I", 150) + b'{"nonce')
    peer.sock.shutdown(socket.SHUT_WR)
    peer.wait_closed()
    peer.close()


def stall(served: Served, stalled: list[Peer]) -> None:
    stalled.append(Peer(served))  # says nothing; closed at the end of the flood


def garbage_before_authenticating(served: Served, stalled: list[Peer]) -> None:
    peer = Peer(served)
    rng = random.Random()
    choice = rng.randrange(4)
    if choice == 0:
        peer.sock.sendall(os.urandom(rng.randint(1, 2048)))
    elif choice == 1:
        peer.hello()
        peer.sock.sendall(_frame(b"[" * 1000))  # JSON nested past the parser's limit
    elif choice == 2:
        peer.hello()
        peer.sock.sendall(_frame(os.urandom(200)))
    else:
        peer.hello()
        peer.sock.sendall(struct.pack(">I", 0xFFFFFFFF) + os.urandom(64))
    peer.close()


GARBAGE_REQUESTS: list[bytes] = [
    b"not json at all",
    b"[" * 5000,
    os.urandom(64),
    json.dumps([]).encode(),
    json.dumps({"method": 5}).encode(),
    json.dumps({"id": 2**70, "method": "hello", "params": []}).encode(),
    json.dumps({"id": 1, "method": "hello", "params": {"layout": {"arrays": "x"}}}).encode(),
    json.dumps({"id": 1, "method": "acquire", "params": {"keys": [1, None]}}).encode(),
    json.dumps({"id": 1, "method": "get", "params": {"lease": "x", "keys": "zz"}}).encode(),
    json.dumps({"id": 1, "method": "put", "params": {"keys": ["00"], "checksums": "x"}}).encode(),
    json.dumps({"id": 1, "method": "publish", "params": {"node_id": [], "keys": 3}}).encode(),
]


def garbage_once_authenticated(served: Served, stalled: list[Peer]) -> None:
    """Authenticates, then sends garbage requests (a fresh connection whenever the server
    closes one): answered with an error, or the connection closed; never more."""
    peer: Peer | None = None
    for body in GARBAGE_REQUESTS:
        if peer is None:
            peer = Peer(served)
            peer.authenticate()
        try:
            peer.sock.sendall(_frame(body))
            answered = peer.sock.recv(65536)  # an error (JSON, or a binary ERROR frame)
        except OSError:
            answered = b""
        if not answered:  # the server closed this one
            peer.close()
            peer = None
    if peer is not None:
        peer.reset()


HOSTILE: list[Callable[[Served, list[Peer]], None]] = [
    reset_at_once,
    reset_mid_tls_or_hello,
    reset_mid_handshake,
    reset_after_a_wrong_proof,
    reset_once_authenticated,
    half_close_at_once,
    half_close_mid_handshake,
    stall,
    garbage_before_authenticating,
    garbage_once_authenticated,
]


def attack(served: Served, rounds: int, stalled: list[Peer], errors: queue.Queue[str]) -> None:
    """Every hostile behaviour, ``rounds`` times over, in a random order."""
    rng = random.Random()
    for _ in range(rounds):
        for behave in rng.sample(HOSTILE, len(HOSTILE)):
            try:
                behave(served, stalled)
            except (OSError, EOFError, ssl.SSLError):
                pass  # the server dropped this peer first: that is its right
            except Exception as exc:  # a bug of the test
                errors.put(f"{behave.__name__}: {exc!r}")


@contextlib.contextmanager
def tls_pair() -> Iterator[Tls]:
    """A self-signed certificate for 127.0.0.1 (see :class:`Tls`), removed afterwards."""
    with tempfile.TemporaryDirectory(prefix="tpusync-trust-loops-") as folder:
        server, client = self_signed_tls(Path(folder))
        yield Tls(server, client, Path(folder) / "cert.pem")


@contextlib.contextmanager
def source_pool() -> Iterator[HostPool]:
    """Blocks a store-node visit pushes: key_for(i) holding payload_for(i)."""
    with HostPool(LAYOUT, 4) as pool:
        keys = [key_for(i) for i in range(4)]
        reservation = pool.reserve(keys)
        for i, slot in enumerate(reservation.slots.tolist()):
            with pool.slot_memory(slot) as memory:
                memory[: LAYOUT.payload_bytes] = payload_for(i)
        pool.commit(reservation, pool.hash_slots(reservation.slots))
        yield pool
