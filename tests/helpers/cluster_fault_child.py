"""A child process for tests/cluster/test_cluster_faults.py: one end of a block transfer, which the
parent SIGKILLs mid-transfer.

    python tests/helpers/cluster_fault_child.py SPEC.json

SPEC (JSON), ``mode`` ``"serve"``::

    {"mode": "serve", "layout": PoolLayout.describe(), "capacity": n, "secret_hex": ...,
     "seed": s, "hold_after": n | null,
     "registry": {"address", "node_id", "ttl_s"} | null}

  Serves an anonymous HostPool with a :class:`BlockServer` and prints ``ready <address>``. Then
  reads one line from stdin, a JSON list of hex keys, stores ``payload_for(seed, i, ...)`` under
  key i and prints ``filled``; with ``registry``, it then publishes them to that registry server
  (a ``RegistryLink``, as a store's ``publish_to`` does) and prints ``published``. Every BLOCK
  frame it sends prints ``sent <n>`` (n counts them all); once ``hold_after`` frames went out,
  the next one is sent only half (header and half the payload), ``holding`` is printed and the
  sending thread stops there until the process is killed. The child exits when its stdin closes.

Mode ``"pull"``::

    {"mode": "pull", "address", "secret_hex", "layout", "keys": [hex, ...], "connections": n}

  Connects a :class:`BlockClient` (``connected``), then pulls the keys into an anonymous HostPool
  and prints ``pulled <count>`` (the parent kills it before).

Every line goes to stdout, flushed, so the parent can wait for each step with a deadline.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from tpusync.cluster import BlockClient, BlockServer, NodeInfo, RemoteRegistry
from tpusync.tiers import HostPool, PoolLayout

HOLD_S = 600.0  # a held sender waits this long: far past any test (the parent kills us first)


def payload_for(seed: int, index: int, nbytes: int) -> bytes:
    """The bytes of block ``index``: random, never a zero byte (the parent checks against it)."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(1, 256, nbytes, dtype=np.uint8).tobytes()


_print_lock = threading.Lock()


def say(line: str) -> None:
    with _print_lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class PacedServer(BlockServer):
    """Reports every BLOCK frame it sends; after ``hold_after`` frames it sends the next one
    half and stops (the hook the data plane documents for tests: ``_send_block``). ``holding``
    is printed only once every frame before the hold is wholly handed to the kernel: with
    several connections, another thread may still be sending its last whole frame (a small
    send buffer makes that wait for the reader)."""

    hold_after: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._started = 0  # whole frames begun
        self._done = 0  # whole frames handed to the kernel
        self._count = threading.Condition()
        super().__init__(*args, **kwargs)

    def _send_block(self, conn: socket.socket, header: bytes, payload: memoryview) -> None:
        with self._count:
            hold = self.hold_after is not None and self._started >= self.hold_after
            if not hold:
                self._started += 1
                n = self._started
        if hold:
            conn.sendall(header)
            conn.sendall(payload[: len(payload) // 2])
            with self._count:
                self._count.wait_for(lambda: self._done == self._started, timeout=HOLD_S)
            say("holding")
            time.sleep(HOLD_S)
            raise ConnectionAbortedError("held")
        super()._send_block(conn, header, payload)
        with self._count:
            self._done += 1
            self._count.notify_all()
        say(f"sent {n}")


def fill(pool: HostPool, keys: list[bytes], seed: int) -> None:
    size = pool.layout.payload_bytes
    reservation = pool.reserve(keys)
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        data = payload_for(seed, keys.index(key), size)
        with pool.slot_memory(slot) as memory:
            memory[:size] = data
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def serve(spec: dict[str, Any]) -> None:
    layout = PoolLayout.from_description(spec["layout"])
    secret = bytes.fromhex(spec["secret_hex"])
    with HostPool(layout, spec["capacity"]) as pool:
        server = PacedServer(pool, secret=secret)
        server.hold_after = spec.get("hold_after")
        say(f"ready {server.address}")
        keys = [bytes.fromhex(k) for k in json.loads(sys.stdin.readline())]
        fill(pool, keys, spec["seed"])
        say("filled")
        link = None
        if spec.get("registry"):
            from tpusync._src.cluster.registry_link import RegistryLink

            reg = spec["registry"]
            registry = RemoteRegistry(reg["address"], secret=secret, timeout_s=5)
            node = NodeInfo(reg["node_id"], addresses=(server.address,))
            link = RegistryLink(registry, node, reg["ttl_s"], pool.keys)
            say("published")
        sys.stdin.read()  # until the parent closes our stdin (or kills us)
        if link is not None:
            link.close()
        server.close()


def pull(spec: dict[str, Any]) -> None:
    layout = PoolLayout.from_description(spec["layout"])
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    with (
        HostPool(layout, len(keys)) as target,
        BlockClient(
            spec["address"],
            secret=bytes.fromhex(spec["secret_hex"]),
            connections=spec.get("connections", 1),
            timeout_s=30,
        ) as client,
    ):
        say("connected")
        loaded = client.pull(keys, target)
        say(f"pulled {sum(loaded)}")


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    {"serve": serve, "pull": pull}[spec["mode"]](spec)


if __name__ == "__main__":
    main()
