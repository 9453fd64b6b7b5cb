"""Move KV blocks between device memory and host memory with tpusync.transfer.

Saves three blocks of a device KV pool into a page-aligned host buffer, loads them back into
other blocks of the pool (K and V of a layer under one future), and checks that every byte came
back. Runs on the CPU backend in a few seconds:

    python examples/transfer.py
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np

import tpusync

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 64, 16, 4, 32  # (blocks, tokens, heads, head_dim)


def main() -> int:
    rng = np.random.default_rng()
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    # The engine's KV pools for one layer, K and V. DevicePool takes ownership of the arrays:
    # read the current one through pool.array.
    k_pool = tpusync.DevicePool(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    v_pool = tpusync.DevicePool(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16))
    host_k = tpusync.HostBuffer((8, *shape[1:]), "bfloat16")  # page-aligned, prefaulted
    host_v = tpusync.HostBuffer((8, *shape[1:]), "bfloat16")

    # Save blocks 3, 17, 42 of the K pool into host slots 0, 1, 2 (asynchronously).
    future = tpusync.transfer(k_pool, host_k, src_blocks=[3, 17, 42], dst_blocks=[0, 1, 2])
    future.result(timeout=10)  # or: await future; future.add_done_callback(...)
    tpusync.transfer(v_pool, host_v, src_blocks=[3, 17, 42], dst_blocks=[0, 1, 2]).result()

    # Load them back into blocks 5, 6, 7: K and V under one future.
    tpusync.transfer_batch(
        [
            tpusync.Transfer(host_k, k_pool, src_blocks=[0, 1, 2], dst_blocks=[5, 6, 7]),
            tpusync.Transfer(host_v, v_pool, src_blocks=[0, 1, 2], dst_blocks=[5, 6, 7]),
        ]
    ).result(timeout=10)

    ok = True
    for pool in (k_pool, v_pool):
        blocks = np.asarray(jax.device_get(pool.array))
        ok &= blocks[[3, 17, 42]].tobytes() == blocks[[5, 6, 7]].tobytes()
    host_k.close()
    host_v.close()
    print(tpusync.info())  # which engine each device gets, and why; host limits
    print("bytes equal" if ok else "MISMATCH: the loaded blocks differ from the saved ones")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
