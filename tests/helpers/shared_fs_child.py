"""Child processes for tests/tiers/test_shared_fs_pool.py (standing in for other hosts), and the
block contents every process agrees on: bytes that are a function of the key (``expected``), so
any process can check any block it is served.

    python tests/helpers/shared_fs_child.py MODE ARGS...   # see main
"""

from __future__ import annotations

import hashlib
import os
import sys
from functools import cache

import numpy as np

from tpusync.tiers import ArrayLayout, HostPool, PoolLayout, SharedFsPool


def small_layout(model: str = "small") -> PoolLayout:
    """Two arrays of 16 KiB per block: for tests that run in this process."""
    arrays = tuple(ArrayLayout(n, "uint16", (16, 512), 0, 1) for n in ("k", "v"))
    return PoolLayout(model, arrays)


def big_layout() -> PoolLayout:
    """Two arrays of 256 KiB per block (512 KiB files): for the cross-process tests."""
    arrays = tuple(ArrayLayout(n, "uint16", (64, 2048), 0, 1) for n in ("k", "v"))
    return PoolLayout("shared-fs-test", arrays)


def key_for(i: int) -> bytes:
    """16 bytes: a hash (so keys spread over the fan-out directories) then the index."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=8).digest() + i.to_bytes(8, "big")


def index_of(key: bytes) -> int:
    return int.from_bytes(key[8:], "big")


@cache
def _noise(n: int) -> bytes:
    return np.random.default_rng(20240601).integers(0, 256, 2 * n, dtype=np.uint8).tobytes()


def expected(key: bytes, n: int) -> bytes:
    """The ``n`` bytes stored under ``key``: the key, then random bytes from a key-dependent
    offset (cheap, so that a writer spends its time writing)."""
    start = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") % n
    return key + _noise(n)[start + len(key) : start + n]


def payload_of(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None, f"{key.hex()} is not in the DRAM pool"
    return bytes(pool.slot_memory(slot)[: pool.layout.payload_bytes])


def fill(pool: HostPool, keys: list[bytes]) -> None:
    """Stores ``expected(key)`` under every key through the slot interface."""
    reservation = pool.reserve(keys)
    n = pool.layout.payload_bytes
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        pool.slot_memory(slot)[:n] = expected(key, n)
    pool.commit(reservation, pool.hash_slots(reservation.slots))


def check_served(pool: HostPool, keys: list[bytes], what: str = "") -> None:
    n = pool.layout.payload_bytes
    for key in keys:
        assert payload_of(pool, key) == expected(key, n), f"{what}: wrong bytes for {key.hex()}"


def worker_read_write(directory: str, first: int, end: int, new_first: int, new_end: int) -> None:
    layout = big_layout()
    theirs = [key_for(i) for i in range(int(first), int(end))]
    ours = [key_for(i) for i in range(int(new_first), int(new_end))]
    with (
        SharedFsPool(layout, directory) as tier,
        HostPool(layout, len(theirs) + len(ours)) as pool,
    ):
        tier.get(theirs, pool)
        check_served(pool, theirs, "read by the child")
        fill(pool, ours)
        assert tier.put(ours, pool) == len(ours)
    print("ok", flush=True)


def worker_rewrite(directory: str, stop_file: str, durability: str) -> None:
    layout = big_layout()
    keys = [key_for(i) for i in range(8)]
    with (
        SharedFsPool(layout, directory, durability=durability) as tier,
        HostPool(layout, len(keys)) as pool,
    ):
        fill(pool, keys)
        tier.put(keys, pool, overwrite=True)
        print("ready", flush=True)
        rounds = 1
        while not os.path.exists(stop_file):
            tier.put(keys, pool, overwrite=True)
            rounds += 1
    print("rounds", rounds, flush=True)


def worker_churn(directory: str) -> None:
    layout = big_layout()
    batch = 3
    with SharedFsPool(layout, directory) as tier, HostPool(layout, 2 * batch) as pool:
        stored = tier.keys()
        start = max((index_of(k) + 1 for k in stored), default=0)
        print("ready", flush=True)
        i = start
        while True:
            keys = [key_for(i + j) for j in range(batch)]
            pool.delete(pool.keys())
            fill(pool, keys)
            tier.put(keys, pool)
            tier.put(keys[:1], pool, overwrite=True)
            tier.delete([key_for(n) for n in range(max(0, i - 4 * batch), max(0, i - 3 * batch))])
            i += batch


def main(argv: list[str]) -> None:
    workers = {
        "read-write": worker_read_write,
        "rewrite": worker_rewrite,
        "churn": worker_churn,
    }
    workers[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
