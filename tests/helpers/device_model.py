"""Device pools with a numpy mirror, for the tests of moves between device pools and a DRAM
pool (tests/tiers/test_host_pool.py, tests/engines/test_pjrt_path.py): what each pool holds now,
what each key stores, and the checks that every replica of every shard holds exactly that."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_dtypes
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync import DevicePool
from tpusync._native import core as _core
from tpusync._src.engines import native
from tpusync.tiers import HostPool, PoolLayout

NB = 8  # blocks of every device pool
BF16 = np.dtype(ml_dtypes.bfloat16)


def put(x: np.ndarray, target: Any = None) -> jax.Array:
    return jax.device_put(np.array(x, copy=True), target or jax.devices()[0])


def at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


def as_bits(array: Any) -> np.ndarray:
    host = np.asarray(array)
    return host.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[host.dtype.itemsize])


KINDS = {
    # name: (global shape, block axis, partition spec or None, sharded axis, distinct shards)
    "per-layer": ((NB, 4, 16), 0, None, None, 1),
    "stacked": ((2, NB, 4, 16), 1, None, None, 1),
    "sharded": ((NB, 4, 8, 16), 0, P(None, None, "a"), 2, 4),  # 2 replicas of each shard
    "stacked-sharded": ((2, NB, 8, 16), 1, P(None, None, "a"), 2, 4),
}


N_ARRAYS = {"per-layer": 4, "stacked": 2, "sharded": 2, "stacked-sharded": 2}


@dataclass
class Model:
    """Device pools of one kind, what each holds now (on the host), and what each key stores."""

    kind: str
    pools: list[DevicePool]
    current: list[np.ndarray]
    block_axis: int
    shard_axis: int | None
    n_shards: int
    layout: PoolLayout
    stored: dict[bytes, list[np.ndarray]] = field(default_factory=dict)

    def block(self, i: int, b: int) -> np.ndarray:
        return np.take(self.current[i], b, axis=self.block_axis)

    def note_put(self, keys: list[bytes], blocks: list[int]) -> None:
        """What a put of these keys stores (keys already present keep their blocks)."""
        for key, b in zip(keys, blocks, strict=True):
            if key not in self.stored:
                self.stored[key] = [self.block(i, b) for i in range(len(self.pools))]

    def note_get(self, keys: list[bytes], blocks: list[int], loaded: list[bool] | None = None):
        loaded = [True] * len(keys) if loaded is None else loaded
        for key, b, ok in zip(keys, blocks, loaded, strict=True):
            if ok:
                for i, current in enumerate(self.current):
                    current[at(self.block_axis, b)] = self.stored[key][i]

    def check(self, what: str = "") -> None:
        """Every replica of every shard of every pool holds exactly what the mirror says."""
        for i, pool in enumerate(self.pools):
            expected = as_bits(self.current[i])
            for shard in pool.array.addressable_shards:
                got = as_bits(shard.data)
                if not np.array_equal(got, expected[shard.index]):
                    wrong = np.argwhere(got != expected[shard.index])
                    raise AssertionError(
                        f"{what}: pool {i}, shard on {shard.device}: {len(wrong)} elements "
                        f"differ, first at {tuple(wrong[0])}"
                    )

    def pieces(self, key: bytes) -> list[bytes]:
        """The bytes of every piece of the key's slot, in the documented order:
        [array][shard (by start index)][outer][inner]."""
        out = []
        for block in self.stored[key]:
            shards = [block]
            if self.shard_axis is not None:
                axis = self.shard_axis - (self.shard_axis > self.block_axis)
                shards = np.split(block, self.n_shards, axis=axis)
            for shard in shards:
                outer = math.prod(shard.shape[: self.block_axis])
                rows = np.ascontiguousarray(shard).reshape(outer, -1)
                out.extend(row.tobytes() for row in rows)
        return out

    def checksum(self, key: bytes) -> int:
        """The block's checksum as the pool format defines it: XXH64 over the pieces' digests
        (little-endian u64, in slot order). The piece digest is the native engine's, taken here
        over the reference bytes (the engine's function itself is tested with the engine)."""
        pieces = self.pieces(key)
        data = np.frombuffer(b"".join(pieces), np.uint8)
        lengths = np.array([len(p) for p in pieces], dtype=np.uint64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
        table = np.stack([data.ctypes.data + starts, np.zeros_like(starts), lengths], axis=1)
        digests = native.engine().hash(np.ascontiguousarray(table, dtype=np.uint64))
        return int(_core.xxh64(np.asarray(digests, dtype="<u8").tobytes()))


def make_model(arrays, rng, mesh, kind: str = "per-layer", dtype: Any = BF16) -> Model:
    shape, axis, spec, shard_axis, n_shards = KINDS[kind]
    target = NamedSharding(mesh, spec) if spec is not None else None
    current = [arrays.random(rng, shape, dtype) for _ in range(N_ARRAYS[kind])]
    pools = [DevicePool(put(x, target), name=f"{kind}{i}") for i, x in enumerate(current)]
    names = [f"layer{i // 2}.{'kv'[i % 2]}" for i in range(len(pools))]
    layout = PoolLayout.from_pools(f"model-{kind}", pools, block_axis=axis, names=names)
    assert layout.arrays[0].n_shards == n_shards
    return Model(kind, pools, [x.copy() for x in current], axis, shard_axis, n_shards, layout)


def keys_for(blocks: list[int], prefix: str = "blk") -> list[bytes]:
    return [f"{prefix}{b}".encode() for b in blocks]


def store(pool: HostPool, model: Model, keys: list[bytes], blocks: list[int], path: str) -> int:
    count = pool.put_from_device(keys, model.pools, blocks, path=path)
    model.note_put(keys, blocks)
    return count


def load(pool: HostPool, model: Model, keys: list[bytes], blocks: list[int], path: str) -> None:
    pool.get_to_device(keys, model.pools, blocks, path=path)
    model.note_get(keys, blocks)
    model.check(f"after loading {keys}")
