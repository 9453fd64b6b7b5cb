"""A named host-memory tier (tpusync.tiers.HostPool in /dev/shm) that outlives its process.

Stores two device KV blocks (K and V of one layer) in a named pool under their keys, loads one
back into another device block (checksum-verified), closes the pool and attaches to it again by
name, as a restarted server would: the blocks are still there. The pool lives in a private
directory under /dev/shm that is removed at the end. Runs on the CPU backend in seconds:

    python examples/host_tiers.py
"""

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import tpusync
from tpusync.tiers import HostPool, PoolLayout

SHAPE = (32, 16, 4, 32)  # (num_blocks, block_size, kv_heads, head_dim)


def main() -> int:
    rng = np.random.default_rng()
    k_pool = tpusync.DevicePool(jnp.asarray(rng.standard_normal(SHAPE), jnp.float32))
    v_pool = tpusync.DevicePool(jnp.asarray(rng.standard_normal(SHAPE), jnp.float32))
    key1, key2 = b"prompt-a/block-0", b"prompt-a/block-1"  # a store's keys are prefix hashes

    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:  # default shm_dir: /dev/shm
        layout = PoolLayout.from_pools("my-model@v3", [k_pool, v_pool])  # what one block is
        host = HostPool(layout, capacity=64, name="host-cache", shm_dir=shm_dir)  # one per server
        host.put_from_device([key1, key2], [k_pool, v_pool], block_ids=[7, 9])
        host.get_to_device([key1], [k_pool, v_pool], block_ids=[3])  # checksum-verified
        host.close()  # a named pool stays in shm_dir

        again = HostPool(layout, capacity=64, name=host.name, shm_dir=shm_dir)  # a restart
        found = again.contains([key1, key2])
        again.get_to_device([key2], [k_pool, v_pool], block_ids=[4])
        print(f"re-attached: {again.attached} in {again.attach_seconds * 1e3:.1f} ms, {found=}")
        again.close()

    ok = all(found)
    for pool in (k_pool, v_pool):
        blocks = np.asarray(jax.device_get(pool.array))
        ok &= blocks[[7, 9]].tobytes() == blocks[[3, 4]].tobytes()
    print("bytes equal" if ok else "MISMATCH: the loaded blocks differ from the stored ones")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
