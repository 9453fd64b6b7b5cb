"""A child process for tests/tiers/test_disk_pool.py, and the block contents both sides agree
on: bytes that are a function of the key (:func:`expected`), so any block served can be checked.

    python tests/helpers/disk_pool_child.py writer DIR DURABILITY  # writes blocks until SIGKILLed
    python tests/helpers/disk_pool_child.py verify DIR            # busy first, then verifies all
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np

from tpusync.errors import PoolBusyError
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout

ROWS, COLS = 16, 512  # one array's part of a block: 16 x 512 bf16 = 16 KiB; slot = 32 KiB
CAPACITY = 48
SLAB_SLOTS = 8
BATCH = 4


def make_layout(model_id: str = "disk-test", rows: int = ROWS) -> PoolLayout:
    arrays = tuple(ArrayLayout(name, "bfloat16", (rows, COLS), 0, 1) for name in ("k", "v"))
    return PoolLayout(model_id, arrays)


def key_for(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def expected(key: bytes, n: int) -> np.ndarray:
    """The payload stored under ``key``: random bytes seeded by the key."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=n, dtype=np.uint8)


def fill(host: HostPool, keys: list[bytes]) -> None:
    """Stores ``expected(key)`` under every key in ``host`` through the slot interface."""
    reservation = host.reserve(keys)
    n = host.layout.payload_bytes
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        with host.slot_memory(slot) as memory:
            np.frombuffer(memory, np.uint8)[:n] = expected(key, n)
    host.commit(reservation, host.hash_slots(reservation.slots))


def check(host: HostPool, keys: list[bytes]) -> None:
    """Every key is committed in ``host`` with exactly its expected bytes."""
    n = host.layout.payload_bytes
    for key in keys:
        slot = host.slot_of(key)
        assert slot is not None, f"{key.hex()} is not in the DRAM pool"
        with host.slot_memory(slot) as memory:
            got = np.frombuffer(memory, np.uint8)[:n]
            if not np.array_equal(got, expected(key, n)):
                raise AssertionError(f"{key.hex()}: wrong bytes")


def load_and_check(disk: DiskPool, keys: list[bytes]) -> None:
    """Loads ``keys`` from ``disk`` into a fresh DRAM pool and checks every byte."""
    with HostPool(disk.layout, max(len(keys), 1)) as host:
        disk.get(keys, host)
        check(host, keys)


def writer(directory: str, durability: str) -> None:
    layout = make_layout()
    disk = DiskPool(layout, CAPACITY, directory, slab_slots=SLAB_SLOTS, durability=durability)
    host = HostPool(layout, BATCH)
    stored = disk.keys()
    i = max((int.from_bytes(k[:8], "little") + 1 for k in stored), default=0)
    print("ready", flush=True)
    while True:
        keys = [key_for(i + j) for j in range(BATCH)]
        fill(host, keys)
        if disk.free < BATCH:
            disk.delete(disk.keys()[:BATCH])  # oldest first: their slots get rewritten
        disk.put(keys, host)
        host.delete(keys)
        i += BATCH


def verify(directory: str) -> None:
    layout = make_layout()
    try:
        DiskPool(layout, CAPACITY, directory, slab_slots=SLAB_SLOTS)
    except PoolBusyError as exc:
        print(f"busy: {exc}", flush=True)
    else:
        print("not busy", flush=True)
        return
    sys.stdin.readline()
    with DiskPool(layout, CAPACITY, directory, slab_slots=SLAB_SLOTS) as disk:
        keys = disk.keys()
        load_and_check(disk, keys)
        print(f"verified {len(keys)}", flush=True)


def main(argv: list[str]) -> None:
    workers = {"writer": writer, "verify": verify}
    workers[argv[0]](*argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
