"""A store node process that stops mid-stream (SIGSTOP) holds up no other: three real `tpusync
serve` children publishing to one registry, a RegistryPool pulling from all three, and one of them
stopped while its blocks stream to the client.

* the other two nodes' blocks land in their normal time: compared with a pull of theirs before
  the stop, with a margin that holds at 5x load, and well before the stopped node's deadline;
* the stopped node's deadline is missed once: its circuit opens, and the next requests skip it
  at once (CircuitOpenError for a client of it; its blocks are misses, counted as skipped);
* after SIGCONT and its back-off (an injected clock: no wait), one probe closes the circuit and
  it serves again, every byte checked.

The tests in tests/cluster/test_peer_isolation.py do this with block servers in this process; here
the node is a real process stopped by the kernel. Every child is stopped by its pid (SIGCONT first,
also when the test fails).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
from preauth_child import LAYOUT, key_for
from test_peer_isolation import Clock, check_bytes, fill, landed_while, pull_aside

from tpusync._native import core as _core
from tpusync._src.cluster.dataplane._connection import Connection
from tpusync._src.testing.polling import eventually
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync.cluster import (
    BlockClient,
    MemoryRegistry,
    PeerCircuits,
    RegistryPool,
    RegistryServer,
    StoreNodePool,
)
from tpusync.errors import BlocksMissingError, CircuitOpenError
from tpusync.tiers import HostPool

SECRET = bytes(range(140, 172))
NODES = 3
BLOCKS = 512  # per node: 8 MiB, more than the sockets buffer, so the stop lands mid-stream
IO_TIMEOUT_S = 3.0  # the client's longest silence: the stopped node's deadline
BACKOFF_S = 30.0  # a circuit's first back-off (the clock is the test's: never waited)
WAIT_S = 30.0  # the longest wait for anything (a margin, not a measurement)


def node_keys(n: int) -> list[bytes]:
    return [key_for(10_000 * (n + 1) + j) for j in range(BLOCKS)]


def first_payload(n: int) -> int:
    return 10_000 * (n + 1)


@contextmanager
def three_node_processes(tmp_path: Path) -> Iterator[tuple[MemoryRegistry, list[Any]]]:
    """A registry served from this process and three `tpusync serve` children publishing to
    it (started at once), each holding its own BLOCKS keys; yields the registry and the
    children (``.pid``, ``.address``). Every child is stopped by its pid on the way out: sent
    SIGCONT first, in case the test stopped it."""
    registry = MemoryRegistry()
    with ExitStack() as stack:
        server = stack.enter_context(RegistryServer(registry, secret=SECRET))
        children: list[Any] = [None] * NODES
        failures: list[BaseException] = []

        def start(n: int) -> None:
            work = tmp_path / f"node-{n}"
            work.mkdir()
            try:
                children[n] = start_store_node(
                    work, SECRET, 32 << 20, registry_port=None,
                    flags=["--registry", f"tcp://{server.address}", "--node-id", f"node-{n}",
                           "--ttl", "120"],
                )  # fmt: skip
            except BaseException as exc:
                failures.append(exc)

        starters = [threading.Thread(target=start, args=(n,)) for n in range(NODES)]
        for thread in starters:
            thread.start()
        for thread in starters:
            thread.join()
        stack.callback(_stop_all, [child[0] for child in children if child is not None])
        if failures:
            raise failures[0]
        nodes = [_Node(process, ready["address"]) for process, ready in children]
        with HostPool(LAYOUT, BLOCKS) as source:
            for n, node in enumerate(nodes):
                source.delete(source.keys())
                fill(source, node_keys(n), first_payload(n))
                with StoreNodePool(node.address, layout=LAYOUT, secret=SECRET) as to:
                    assert to.put(node_keys(n), source) == BLOCKS
        everything = [k for n in range(NODES) for k in node_keys(n)]
        eventually(  # each node publishes what it took
            lambda: all(registry.holders(everything)), WAIT_S, "the nodes published their blocks"
        )
        yield registry, nodes


class _Node:
    def __init__(self, process: subprocess.Popen[str], address: str) -> None:
        self.process, self.pid, self.address = process, process.pid, address


def _stop_all(processes: list[subprocess.Popen[str]]) -> None:
    """Stops every child by its pid: SIGCONT (a stopped child cannot act on SIGTERM) and
    SIGTERM to all first, so that they shut down together; then each is waited for (and
    killed after a while)."""
    for process in processes:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.terminate()
    for process in processes:
        stop_process(process)


def test_a_stopped_node_holds_up_no_other_and_is_skipped_until_it_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    circuits = PeerCircuits(first_backoff_s=BACKOFF_S, clock=clock)
    everything = [k for n in range(NODES) for k in node_keys(n)]
    others = node_keys(0) + node_keys(2)
    with (
        three_node_processes(tmp_path) as (registry, nodes),
        RegistryPool(
            registry, LAYOUT, secret=SECRET, timeout_s=IO_TIMEOUT_S, same_host=False,
            circuits=circuits,
        ) as cluster,
        HostPool(LAYOUT, NODES * BLOCKS) as warm,
        HostPool(LAYOUT, NODES * BLOCKS) as target,
    ):  # fmt: skip
        cluster.get(everything, warm)  # connects to all three; every block arrives
        warm.delete(warm.keys())
        started = time.monotonic()
        cluster.get(others, warm)  # the other two's normal time, on this machine, now
        normal = time.monotonic() - started
        for n in (0, 2):
            check_bytes(warm, node_keys(n), first_payload(n))

        # node-1 is stopped by the kernel once the first bytes of its stream have arrived
        stopped = nodes[1]
        stop_now = threading.Event()
        was_stopped = threading.Event()
        stream: list[Any] = []  # node-1's receiver, whose byte count says where it stopped
        receive_frames = Connection.receive_frames

        def first_bytes_then_stop(self: Connection, receiver: Any, deadline: Any) -> int:
            if self.label == stopped.address and stop_now.is_set() and not was_stopped.is_set():
                until = time.monotonic() + WAIT_S
                status = _core.FRAMES_TIMEOUT
                while not receiver.bytes_read and status == _core.FRAMES_TIMEOUT:
                    assert time.monotonic() < until, "node-1 sent nothing"
                    status = receiver.run(0.0, IO_TIMEOUT_S)  # one read at most
                os.kill(stopped.pid, signal.SIGSTOP)
                stream.append(receiver)
                was_stopped.set()
                if status != _core.FRAMES_TIMEOUT:
                    return int(status)
            return receive_frames(self, receiver, deadline)

        monkeypatch.setattr(Connection, "receive_frames", first_bytes_then_stop)
        puller, failed = pull_aside(cluster, everything, target)
        stop_now.set()
        started = time.monotonic()
        puller.start()
        last_of_others = [node_keys(0)[-1], node_keys(2)[-1]]  # a node's blocks commit at once
        others_landed = landed_while(puller, target, last_of_others, started)
        assert was_stopped.wait(WAIT_S), "node-1 was never stopped"
        assert others_landed is not None, "the other nodes' blocks waited for the stopped one"
        print(f"the others' blocks: {normal:.3f} s before the stop, {others_landed:.3f} s with "
              f"node-1 stopped (its deadline: {IO_TIMEOUT_S} s of silence)")  # fmt: skip
        assert others_landed < 5 * normal + 1.0, (others_landed, normal)
        puller.join(WAIT_S)
        assert not puller.is_alive()
        whole = BLOCKS * (LAYOUT.payload_bytes + 96)  # its response: a frame per block
        assert 0 < stream[0].bytes_read < whole  # it stopped mid-stream, and sent no more
        del stream[:]  # before the memory it landed in may go
        assert len(failed) == 1 and isinstance(failed[0], BlocksMissingError), failed
        loaded = failed[0].loaded
        assert all(loaded[:BLOCKS]) and all(loaded[2 * BLOCKS :])
        assert not any(loaded[BLOCKS : 2 * BLOCKS])  # a pull past its deadline commits nothing
        check_bytes(target, node_keys(0), first_payload(0))
        check_bytes(target, node_keys(2), first_payload(2))

        # its circuit is open: the next requests skip it at once, nothing sent to it
        assert circuits.state(stopped.address) == "open"
        skipped = circuits.skipped
        started = time.monotonic()
        with pytest.raises(BlocksMissingError) as missing:
            cluster.get(node_keys(1), target)
        assert time.monotonic() - started < IO_TIMEOUT_S  # no deadline was waited out
        assert not any(missing.value.loaded)
        assert circuits.skipped == skipped + 1
        with pytest.raises(CircuitOpenError, match="not asked"):
            BlockClient(stopped.address, secret=SECRET, layout=LAYOUT, circuits=circuits)
        cluster.get(others, target)  # the others serve on as before

        # it answers again; after its back-off one probe closes the circuit, and it serves
        os.kill(stopped.pid, signal.SIGCONT)
        clock.now += BACKOFF_S
        assert circuits.state(stopped.address) == "half-open"
        cluster.get(node_keys(1), target)
        assert circuits.state(stopped.address) == "closed"
        check_bytes(target, node_keys(1), first_payload(1))
