"""A child process for tests/cluster/test_preauth.py: one tpusync server under attack, in a
process of its own so that its memory (VmRSS) and threads can be read from /proc.

    python tests/helpers/preauth_child.py KIND SECRET_HEX

KIND is ``block`` (a BlockServer over a HostPool holding ``BLOCKS`` blocks of
``payload_for(i)`` under ``key_for(i)``), ``store`` (a StoreServer lending 16 MiB) or
``registry`` (a RegistryServer over a MemoryRegistry). The child logs to stderr (WARNING and
up), prints ``ready <address>`` and serves until its stdin closes; then it prints
``refusals <json>`` (the server's refusal counts by reason) and exits.
"""

from __future__ import annotations

import json
import logging
import sys

import numpy as np

from tpusync.cluster import BlockServer, MemoryRegistry, RegistryServer, StoreServer
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

LAYOUT = PoolLayout("preauth", (ArrayLayout("k", "uint8", (16 * 1024,), 0, 1),))
BLOCKS = 8
SEED = 20250118


def key_for(i: int) -> bytes:
    return b"preauth-" + i.to_bytes(4, "little")


def payload_for(i: int) -> bytes:
    """Block ``i``'s bytes: random, never a zero byte."""
    rng = np.random.default_rng([SEED, i])
    return rng.integers(1, 256, LAYOUT.payload_bytes, dtype=np.uint8).tobytes()


def fill(pool: HostPool, n: int) -> None:
    keys = [key_for(i) for i in range(n)]
    reservation = pool.reserve(keys)
    for i, slot in enumerate(reservation.slots.tolist()):
        with pool.slot_memory(slot) as memory:
            memory[: LAYOUT.payload_bytes] = payload_for(i)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def main() -> None:
    kind, secret = sys.argv[1], bytes.fromhex(sys.argv[2])
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    pool = None
    server: BlockServer | RegistryServer
    if kind == "block":
        pool = HostPool(LAYOUT, BLOCKS)
        fill(pool, BLOCKS)
        server = BlockServer(pool, secret=secret)
    elif kind == "store":
        server = StoreServer(16 << 20, secret=secret)
    else:
        server = RegistryServer(MemoryRegistry(), secret=secret)
    print(f"ready {server.address}", flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or kills us)
    refusals = server.refusals() if hasattr(server, "refusals") else {}
    print(f"refusals {json.dumps(refusals)}", flush=True)
    server.close()
    if pool is not None:
        pool.close()


if __name__ == "__main__":
    main()
