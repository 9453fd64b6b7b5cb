"""One process of a 2-process multi-controller JAX job sharing KV through the ``jax`` registry
(run by tests/kv/test_kv_multicontroller.py)::

    TPUSYNC_TEST_SECRET=<hex> python kv_multicontroller_child.py <process_id> <port> <seed> <path>

(``path``: the transfer engine, ``native`` or ``jax``.)

Each process has 4 fake CPU devices; ``jax.distributed`` joins them into one 8-device job whose
mesh is ``("replica", 2) x ("tp", 4)``, the replica axis spanning the processes. The KV pools (K
and V of each layer, ``(blocks, kv_heads, block_size, head_dim)`` bfloat16) are sharded over
``tp`` inside each process and replicated across processes (``P(None, "tp")``), so each
process's addressable shards are one whole replica, and each process's store holds its replica's
four shards in every slot.

Process 0 writes known KV (derived from the seed) into some of its pool blocks, saves the token
prefix, serves its DRAM tier with a ``BlockServer`` and publishes its keys through a
``JaxRegistry`` on the job's coordination service. Process 1, given nothing but that registry,
looks the prefix up (a ``RegistryPool`` tier), pulls it over TCP and loads it into other blocks
of its own pools, then compares every addressable shard with the seed's KV bit for bit. Barriers
of the coordination service order the steps. The last stdout line is a JSON object of what this
process saw; the parent asserts on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

N_DEVICES = 4  # per process
LAYERS = 2
NUM_BLOCKS = 16
KV_HEADS = 4  # sharded over the 4 "tp" devices of each process
BLOCK_SIZE = 16  # tokens per block
TOKEN_AXIS = 2  # pools are (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM): see pool_shape()
HEAD_DIM = 32
PREFIX_TOKENS = 3 * BLOCK_SIZE + 5  # three full blocks and a partial one (never saved)
SAVED_BLOCKS = [5, 2, 9]  # process 0's device blocks for the prefix
LOADED_BLOCKS = [11, 0, 7]  # process 1's
MODEL_ID = "toy-multicontroller"
REGISTRY_PREFIX = "tpusync-test/kv-mc"
BARRIER_MS = 15_000
SECRET_ENV = "TPUSYNC_TEST_SECRET"

# --- the parent's side ---------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(
    pid: int, port: int, seed: int, path: str, secret: bytes, workdir: Path
) -> subprocess.Popen[bytes]:
    """Starts process ``pid`` of the job; its stdout and stderr go to files in ``workdir``."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", SECRET_ENV: secret.hex()}
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    with (workdir / f"mc{pid}.out").open("wb") as out, (workdir / f"mc{pid}.err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, __file__, str(pid), str(port), str(seed), path],
            stdout=out,
            stderr=err,
            env=env,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stops a child we started, by its pid: terminate, wait, kill."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


# --- both sides: the KV every process can compute from the seed ------------------------------


def pool_shape() -> tuple[int, int, int, int]:
    return (NUM_BLOCKS, KV_HEADS, BLOCK_SIZE, HEAD_DIM)


def random_bf16(seed: int, *labels: int, shape: tuple[int, ...]) -> Any:
    """Random bfloat16 *bits* (never a zero byte, with NaN payloads planted first)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng([seed, *labels])
    raw = rng.integers(1, 256, size=int(np.prod(shape)) * 2, dtype=np.uint8)
    words = raw.view(np.uint16)
    words[:4] = (0x7FBF, 0xFFC1, 0x7F81, 0x7FC1)  # payloads a value-level copy would change
    return words.view(ml_dtypes.bfloat16).reshape(shape)


def background(seed: int, pool: int) -> Any:
    """Pool ``pool``'s initial contents (the same in both processes)."""
    return random_bf16(seed, 1, pool, shape=pool_shape())


def prefix_kv(seed: int, pool: int) -> Any:
    """The KV process 0 writes for the prefix: (saved blocks, kv_heads, block_size, head_dim)."""
    return random_bf16(seed, 2, pool, shape=(len(SAVED_BLOCKS), *pool_shape()[1:]))


def prefix_tokens(seed: int) -> Any:
    import numpy as np

    return np.random.default_rng([seed, 3]).integers(0, 50_000, PREFIX_TOKENS).astype(np.int32)


def digest(array: Any) -> str:
    import numpy as np

    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).hexdigest()


# --- the child's side ----------------------------------------------------------------------


def count_engine_calls() -> dict[str, int]:
    """Counts the batches each transfer engine runs in this process (to show which one did)."""
    from tpusync._src.engines import native, pure_jax

    calls = {"native": 0, "jax": 0}

    def counted(module: Any, name: str, engine: str) -> None:
        inner = getattr(module, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[engine] += 1
            return inner(*args, **kwargs)

        setattr(module, name, wrapper)

    counted(native, "run", "native")
    counted(native, "run_hashed", "native")
    counted(native, "run_hashed_plan", "native")
    counted(pure_jax, "run", "jax")
    return calls


def main() -> None:
    pid, port, seed, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    secret = bytes.fromhex(os.environ[SECRET_ENV])

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=2,
        process_id=pid,
        initialization_timeout=20,
        heartbeat_timeout_seconds=5,  # the defaults are minutes
        shutdown_timeout_seconds=5,
    )
    import dataclasses

    import numpy as np
    from jax._src.distributed import global_state
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import tpusync
    from tpusync._src.cluster import serving
    from tpusync.cluster import BlockServer, JaxRegistry, NodeInfo, RegistryPool
    from tpusync.kv import DramTier, ExistingTier, KVCacheStore, KVStoreConfig
    from tpusync.tiers import PoolLayout

    client = global_state.client
    engines = count_engine_calls()

    def barrier(name: str) -> None:
        client.wait_at_barrier(f"tpusync-kv-mc-{name}", BARRIER_MS)

    # The global mesh: one row of 4 devices per process.
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices).reshape(2, N_DEVICES)
    assert [{d.process_index for d in row} for row in grid] == [{0}, {1}]
    auto = jax.sharding.AxisType.Auto
    mesh = jax.sharding.Mesh(grid, ("replica", "tp"), axis_types=(auto, auto))
    sharding = NamedSharding(mesh, P(None, "tp"))

    n_pools = 2 * LAYERS  # K and V of each layer
    pools = []
    for i in range(n_pools):
        init = background(seed, i)  # each process fills its own addressable shards
        array = jax.make_array_from_callback(pool_shape(), sharding, init.__getitem__)
        pools.append(tpusync.DevicePool(array, name=f"{'kv'[i % 2]}{i // 2}"))
    out: dict[str, Any] = {
        "pid": pid,
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
        "fully_addressable": pools[0].array.is_fully_addressable,
    }

    registry = JaxRegistry(prefix=REGISTRY_PREFIX)
    tokens = prefix_tokens(seed)

    def shard_blocks(pool: Any, blocks: list[int]) -> dict[str, Any]:
        """Each addressable shard's blocks, keyed by the shard's first kv head."""
        found = {}
        for shard in pool.array.addressable_shards:
            head = shard.index[1].indices(KV_HEADS)[0]
            found[str(head)] = (shard, np.asarray(shard.data)[blocks])
        return found

    if pid == 0:  # the prefill side: write, save, serve, publish
        layout = PoolLayout.from_pools(MODEL_ID, pools)
        config = KVStoreConfig(
            MODEL_ID,
            BLOCK_SIZE,
            DramTier(capacity_blocks=8),
            secret=secret,
            path=path,
            token_axis=TOKEN_AXIS,
        )
        store = KVCacheStore(config, pools)
        server = BlockServer(store.dram, secret=secret)
        serving.publish_to(
            store, registry, NodeInfo("replica-0", addresses=(server.address,)), ttl_s=5.0
        )
        moves = []
        for i, pool in enumerate(pools):
            kv = prefix_kv(seed, i)  # host side of a sharded pool: [shard][blocks...]
            host = np.stack([kv[:, s : s + 1] for s in range(KV_HEADS)])
            moves.append(tpusync.Transfer(host, pool, dst_blocks=SAVED_BLOCKS))
        tpusync.transfer_batch(moves, path=path).result(timeout=10)
        out["written"] = [
            {h: digest(blocks) for h, (_, blocks) in shard_blocks(pool, SAVED_BLOCKS).items()}
            for pool in pools
        ]
        saved = store.save(tokens, SAVED_BLOCKS)
        out["stored_blocks"] = saved.stored_blocks
        assert store.flush(10)  # saved, and published to the registry
        out["holders"] = [
            [h.node_id for h in held] for held in registry.holders(store._keys(tokens, None)[1])
        ]
        out["layout_shards"] = [a.n_shards for a in layout.arrays]
        barrier("published")
        barrier("loaded")  # process 1 pulls from our BlockServer meanwhile
        out["leases_expired"], out["rejected"] = server.leases.expired, server.rejected
        server.close()
        store.close()  # unregisters replica-0
        barrier("closed")
    else:  # the decode side: only the registry tells it where the prefix is
        layout = PoolLayout.from_pools(MODEL_ID, pools)
        cluster = RegistryPool(registry, layout, secret=secret, exclude="replica-1", timeout_s=5)
        store = KVCacheStore(
            KVStoreConfig(
                MODEL_ID,
                BLOCK_SIZE,
                DramTier(capacity_blocks=8),
                secret=secret,
                tiers=(ExistingTier("cluster", cluster),),
                path=path,
                token_axis=TOKEN_AXIS,
            ),
            pools,
        )
        before = [
            {h: digest(blocks) for h, (_, blocks) in shard_blocks(pool, LOADED_BLOCKS).items()}
            for pool in pools
        ]
        barrier("published")
        hit = store.lookup(tokens)
        out["cached_tokens"], out["lookup_tiers"] = hit.cached_tokens, list(hit.tiers)
        loaded = store.load(hit, LOADED_BLOCKS)
        out["loaded_tokens"] = loaded.loaded_tokens
        out["promoted_blocks"] = loaded.promoted_blocks
        # Every addressable shard, bit for bit: the loaded blocks hold what process 0 wrote,
        # every other block still holds its background.
        out["loaded"], out["mismatches"], out["untouched_mismatches"] = [], [], []
        others = [b for b in range(NUM_BLOCKS) if b not in LOADED_BLOCKS]
        for i, pool in enumerate(pools):
            expected, init = prefix_kv(seed, i), background(seed, i)
            digests = {}
            for head, (shard, blocks) in shard_blocks(pool, LOADED_BLOCKS).items():
                want = expected[:, shard.index[1]]
                digests[head] = digest(blocks)
                wrong = int(np.count_nonzero(blocks.view(np.uint16) != want.view(np.uint16)))
                rest = np.asarray(shard.data)[others]
                kept = init[others][:, shard.index[1]]
                changed = int(np.count_nonzero(rest.view(np.uint16) != kept.view(np.uint16)))
                out["mismatches"].append([i, int(head), wrong])
                out["untouched_mismatches"].append([i, int(head), changed])
            out["loaded"].append(digests)
        out["changed_from_before"] = [
            sorted(h for h in now if now[h] != was[h])
            for now, was in zip(out["loaded"], before, strict=True)
        ]
        # Misses: a prefix never saved, another weight version, another tenant; and a prompt
        # that leaves the saved prefix after its first block.
        other_tokens = tokens.copy()
        other_tokens[BLOCK_SIZE] += 1  # the second block differs: only the first one matches
        misses = {
            "never_saved": (np.arange(PREFIX_TOKENS, dtype=np.int32) + 7, None),
            "weight_version": (tokens, dataclasses.replace(store.namespace, weight_version="v2")),
            "tenant": (tokens, dataclasses.replace(store.namespace, salt=b"other-tenant")),
            "diverges_at_block_1": (other_tokens, None),
        }
        out["misses"] = {}
        for name, (toks, namespace) in misses.items():
            with store.lookup(toks, namespace=namespace) as handle:
                out["misses"][name] = handle.num_blocks
        out["cluster_stats"] = store.stats()["tiers"]["cluster"]
        barrier("loaded")
        barrier("closed")
        out["nodes_after_close"] = [n.node_id for n in registry.nodes()]
        store.close()
        cluster.close()
    out["engine_calls"] = engines
    registry.close()
    jax.distributed.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
