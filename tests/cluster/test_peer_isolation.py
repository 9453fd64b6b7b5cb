"""One slow or dead peer never holds up the others (the class of TPU
Sync's issue #888). Real block servers on loopback, a real registry, a RegistryPool (the KV
store's lower tier over the cluster) pulling from three nodes, one of which stalls mid-stream:

* the pulls from the other two land while the stalled one is still stalled (no deadline of
  theirs waits for it);
* the stall is a missed deadline: the stalled node's circuit opens, and the next requests for
  its blocks are misses at once, without a lease asked of it (attempts are counted, not timed);
* once it answers again and its back-off is over, one probe closes the circuit and it serves
  again.

Plus the circuit's rules on their own, and an RPC's deadline that a trickling peer cannot
stretch. Waits are on events or bounded by generous margins; no bound here fails at 5x load.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from preauth_child import LAYOUT, key_for, payload_for

from tpusync.cluster import (
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    PeerCircuits,
    RegistryPool,
    RemoteRegistry,
)
from tpusync.errors import (
    BlocksMissingError,
    CircuitOpenError,
    InvalidArgumentError,
    RegistryUnavailableError,
)
from tpusync.tiers import HostPool

SECRET = bytes(range(7, 39))
BLOCKS = 24  # per node
STALL_AFTER = 4  # blocks a stalling node sends before it stops
IO_TIMEOUT_S = 3.0  # the client's deadline: a node silent this long has stalled
WAIT_S = 30.0  # the longest wait for anything (a margin, not a measurement)


class Clock:
    """A monotonic clock the test moves on (a circuit's back-off ends without waiting)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class StallingServer(BlockServer):
    """A block server that, once ``stall`` is set, stops after STALL_AFTER blocks of a get
    until ``resume`` is set (a peer that stops answering mid-stream), and counts its leases."""

    def __init__(self, pool: HostPool) -> None:
        self.leases_asked = 0
        self.stall = threading.Event()
        self.stalled = threading.Event()
        self.resume = threading.Event()
        self._sent = 0
        super().__init__(pool, secret=SECRET, before_lease=self._count)

    def _count(self, keys: list[bytes]) -> None:
        self.leases_asked += 1

    def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
        if self.stall.is_set():
            self._sent += 1
            if self._sent > STALL_AFTER:
                self.stalled.set()
                self.resume.wait(WAIT_S)
        super()._send_block(conn, header, data)


def node_keys(n: int) -> list[bytes]:
    return [key_for(100 * n + j) for j in range(BLOCKS)]


def fill(pool: HostPool, keys: list[bytes], first: int) -> None:
    reservation = pool.reserve(keys)
    for j, slot in enumerate(reservation.slots.tolist()):
        with pool.slot_memory(slot) as memory:
            memory[: LAYOUT.payload_bytes] = payload_for(first + j)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def check_bytes(target: HostPool, keys: list[bytes], first: int) -> None:
    for j, key in enumerate(keys):
        slot = target.slot_of(key)
        assert slot is not None, key
        with target.slot_memory(slot) as memory:
            assert bytes(memory[: LAYOUT.payload_bytes]) == payload_for(first + j)


@contextmanager
def three_nodes() -> Iterator[tuple[MemoryRegistry, list[StallingServer]]]:
    """Three block servers, node-0..2, each holding its own BLOCKS keys, in one registry."""
    registry = MemoryRegistry()
    with ExitStack() as stack:
        servers = []
        for n in range(3):
            pool = stack.enter_context(HostPool(LAYOUT, 2 * BLOCKS))  # room for a replica
            fill(pool, node_keys(n), 100 * n)
            server = stack.enter_context(StallingServer(pool))
            registry.register(NodeInfo(f"node-{n}", (server.address,)), 600)
            registry.publish(f"node-{n}", node_keys(n), "dram")
            servers.append(server)
            stack.callback(server.resume.set)  # first: a stalled send lets go of its slots
        yield registry, servers


def pull_aside(
    pool: Any, keys: list[bytes], target: HostPool
) -> tuple[threading.Thread, list[BaseException]]:
    """``pool.get(keys, target)`` on a thread of its own, not started yet; what it raised is
    appended to the list."""
    failed: list[BaseException] = []

    def pull() -> None:
        try:
            pool.get(keys, target)
        except BaseException as exc:
            failed.append(exc)

    return threading.Thread(target=pull), failed


def landed_while(
    puller: threading.Thread, target: HostPool, keys: list[bytes], started: float
) -> float | None:
    """Seconds from ``started`` until every key of ``keys`` is in ``target``, watched while
    ``puller`` runs; None if it ended first."""
    while puller.is_alive():
        if all(target.contains(keys)):
            return time.monotonic() - started
        time.sleep(0.005)
    return None


def test_a_stalled_node_holds_up_no_other_and_is_skipped_until_it_answers() -> None:
    clock = Clock()
    circuits = PeerCircuits(first_backoff_s=5.0, clock=clock)
    everything = [k for n in range(3) for k in node_keys(n)]
    others = node_keys(0) + node_keys(2)
    with (
        three_nodes() as (registry, servers),
        RegistryPool(
            registry, LAYOUT, secret=SECRET, timeout_s=IO_TIMEOUT_S, same_host=False,
            circuits=circuits,
        ) as cluster,
        HostPool(LAYOUT, 4 * BLOCKS) as warm,
        HostPool(LAYOUT, 4 * BLOCKS) as target,
    ):  # fmt: skip
        cluster.get(everything, warm)  # connects to all three; every block arrives
        for n in range(3):
            check_bytes(warm, node_keys(n), 100 * n)
        stalling = servers[1]
        stalling.stall.set()
        puller, failed = pull_aside(cluster, everything, target)
        started = time.monotonic()
        puller.start()
        assert stalling.stalled.wait(WAIT_S), "node-1 never stalled"
        # the other two nodes' blocks land while node-1 is still stalled and the pull waits
        others_landed = landed_while(puller, target, others, started)
        assert others_landed is not None, "the other nodes' blocks waited for the stalled one"
        assert puller.is_alive()  # still waiting for node-1's deadline
        puller.join(WAIT_S)
        assert not puller.is_alive()
        assert len(failed) == 1 and isinstance(failed[0], BlocksMissingError)
        loaded = failed[0].loaded
        assert all(loaded[:BLOCKS]) and all(loaded[2 * BLOCKS :])
        assert not all(loaded[BLOCKS : 2 * BLOCKS])  # what node-1 sent before it stopped may land
        check_bytes(target, node_keys(0), 0)
        check_bytes(target, node_keys(2), 200)
        print(f"others landed after {others_landed:.3f} s; the stalled node's deadline: "
              f"{IO_TIMEOUT_S} s")  # fmt: skip

        # node-1's circuit is open: its blocks are misses at once, nothing is asked of it
        target.delete(node_keys(1))
        address = stalling.address
        assert circuits.state(address) == "open"
        asked = stalling.leases_asked
        skipped = circuits.skipped
        with pytest.raises(BlocksMissingError) as missing:
            cluster.get(node_keys(1), target)
        assert not any(missing.value.loaded)
        assert stalling.leases_asked == asked
        assert circuits.skipped == skipped + 1
        assert cluster.contains(node_keys(1)) == [True] * BLOCKS  # the registry still lists it
        cluster.get(others, target)  # the others serve on as before

        # it answers again; after its back-off one probe closes the circuit, and it serves
        stalling.stall.clear()
        stalling.resume.set()
        with pytest.raises(BlocksMissingError):  # still resting: not asked yet
            cluster.get(node_keys(1), target)
        assert stalling.leases_asked == asked
        clock.now += 5.0
        assert circuits.state(address) == "half-open"
        cluster.get(node_keys(1), target)
        assert stalling.leases_asked == asked + 1
        assert circuits.state(address) == "closed"
        check_bytes(target, node_keys(1), 100)


def test_a_holder_whose_circuit_is_open_is_passed_over_for_another() -> None:
    """A key two nodes hold is pulled from the one whose circuit lets requests through."""
    clock = Clock()
    circuits = PeerCircuits(clock=clock)
    with (
        three_nodes() as (registry, servers),
        RegistryPool(registry, LAYOUT, secret=SECRET, same_host=False, circuits=circuits) as cl,
        HostPool(LAYOUT, 2 * BLOCKS) as target,
    ):
        keys = node_keys(0)
        fill(servers[1].pool, keys, 0)  # node-1 holds node-0's blocks too
        registry.publish("node-1", keys, "dram")
        cl.get(node_keys(2), target)  # node-0's address is known to the pool from now on
        cl.get(keys[:1], target)  # node-0 first: the first live holder by node id
        assert servers[0].leases_asked == 1
        circuits.failed(servers[0].address, TimeoutError("stalled"))
        cl.get(keys[1:], target)
        assert servers[0].leases_asked == 1 and servers[1].leases_asked == 1
        check_bytes(target, keys, 0)


def test_circuit_rules() -> None:
    clock = Clock()
    circuits = PeerCircuits(threshold=3, first_backoff_s=1.0, longest_backoff_s=4.0, clock=clock)
    peer = "10.0.0.1:7000"
    for _ in range(2):  # below the threshold: still closed
        circuits.admit(peer)
        circuits.failed(peer, ConnectionResetError())
    assert circuits.state(peer) == "closed"
    circuits.admit(peer)
    circuits.failed(peer, ConnectionResetError())  # the third in a row opens it
    assert circuits.state(peer) == "open" and circuits.open_peers() == [peer]
    with pytest.raises(CircuitOpenError, match=r"10\.0\.0\.1:7000: not asked"):
        circuits.admit(peer)
    clock.now += 1.0
    assert circuits.state(peer) == "half-open" and circuits.available(peer)
    circuits.admit(peer)  # the probe
    with pytest.raises(CircuitOpenError):  # one probe at a time
        circuits.admit(peer)
    circuits.failed(peer, ConnectionRefusedError())  # the probe failed: open for twice as long
    clock.now += 1.5
    assert circuits.state(peer) == "open"
    clock.now += 0.5
    circuits.admit(peer)
    circuits.succeeded(peer)
    assert circuits.state(peer) == "closed" and circuits.open_peers() == []
    # a missed deadline opens it at once; back-offs stop growing at the longest
    other = "10.0.0.2:7000"
    late = RegistryUnavailableError("no answer in time")
    late.__cause__ = TimeoutError("the request's deadline passed")
    circuits.failed(other, late)
    assert circuits.state(other) == "open"
    for _ in range(5):
        clock.now += 10.0
        circuits.admit(other)
        circuits.failed(other, ConnectionResetError())
    clock.now += 3.9
    assert circuits.state(other) == "open"
    clock.now += 0.1
    assert circuits.state(other) == "half-open"
    with pytest.raises(InvalidArgumentError, match="threshold"):
        PeerCircuits(threshold=0)
    with pytest.raises(InvalidArgumentError, match="longest_backoff_s"):
        PeerCircuits(first_backoff_s=2.0, longest_backoff_s=1.0)


def test_a_trickling_registry_cannot_stretch_a_request_past_its_deadline() -> None:
    """A 'server' that sends its hello one byte every half second: a per-syscall timeout of
    1 s would never fire; the request's deadline (1 s, for connecting and all) does."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            for byte in b"\x00\x00\x01\x00" + b"{" * 256:
                if stop.wait(0.5):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        host, port = listener.getsockname()
        started = time.monotonic()
        with pytest.raises(RegistryUnavailableError):
            RemoteRegistry(f"{host}:{port}", secret=SECRET, timeout_s=1.0)
        took = time.monotonic() - started
        assert took < 1.0 + 5.0, took  # without the deadline: 128 s of trickle
    finally:
        stop.set()
        listener.close()
        thread.join(WAIT_S)
