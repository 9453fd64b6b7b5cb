"""A child process for tests/tiers/test_crash.py: writes blocks into a named HostPool forever.

Every block's bytes are a function of its key (see ``block_bytes``), so a survivor can check any
block it is served. The parent SIGKILLs this process at a random moment.

    python tests/helpers/crash_writer.py NAME SHM_DIR
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import tpusync
from tpusync.tiers import HostPool, PoolLayout

BLOCKS, ROWS, COLS = 8, 64, 2048  # one block of one array: 64 x 2048 bf16 = 256 KiB
N_ARRAYS = 2
CAPACITY = 24
BATCH = 4


def key_for(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def block_bytes(key: bytes, array: int) -> np.ndarray:
    """The bits stored under ``key`` for array ``array``: random, never all zeros."""
    rng = np.random.default_rng([int.from_bytes(key[:8], "little"), array])
    return rng.integers(1, 2**16, size=(ROWS, COLS), dtype=np.uint16)


def make_pools() -> list[tpusync.DevicePool]:
    zeros = np.zeros((BLOCKS, ROWS, COLS), np.uint16).view(jax.numpy.bfloat16)
    return [tpusync.DevicePool(jax.device_put(zeros)) for _ in range(N_ARRAYS)]


def make_layout(pools: list[tpusync.DevicePool]) -> PoolLayout:
    return PoolLayout.from_pools("crash-test", pools, names=["k", "v"])


def main() -> None:
    name, shm_dir = sys.argv[1], sys.argv[2]
    pools = make_pools()
    pool = HostPool(make_layout(pools), CAPACITY, name=name, shm_dir=shm_dir)
    stored = pool.keys()
    start = max((int.from_bytes(k[:8], "little") + 1 for k in stored), default=0)
    print("ready", flush=True)
    i = start
    while True:
        keys = [key_for(i + j) for j in range(BATCH)]
        for a, device_pool in enumerate(pools):
            host = np.stack([block_bytes(k, a) for k in keys]).view(jax.numpy.bfloat16)
            tpusync.transfer(host, device_pool, dst_blocks=range(BATCH)).result()
        if pool.free < BATCH:
            pool.delete(pool.keys()[:BATCH])  # oldest first: their slots get reused
        pool.put_from_device(keys, pools, range(BATCH))
        i += BATCH


if __name__ == "__main__":
    main()
