"""What a :class:`~tpusync.tiers.HostPool` keeps for its moves with device pools: the pools'
locks in transfer's order, the native plans per direction (:class:`KeptPools`), and the small
checks and reshapes of those moves."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tpusync.engines import native
from tpusync.memory.device_pool import DevicePool
from tpusync.memory.torch_tensors import TorchPool

__all__ = ["KeptPools", "PoolLocks", "native_ready", "num_blocks", "slot_major"]


def num_blocks(pool: DevicePool | jax.Array, block_axis: int) -> int:
    array = pool._array if isinstance(pool, DevicePool) else pool
    return int(array.shape[block_axis])


def native_ready(pools: Sequence[DevicePool | TorchPool], write: bool) -> bool:
    """Whether the native engine can read (or write) every pool's current array (its layout
    may change between calls, unlike its shape; a TorchPool's tensor must still be where it
    was); called with the pools locked."""
    return all(
        pool.in_place()
        if isinstance(pool, TorchPool)
        else native.pool_unavailable_reason(pool, write) is None
        for pool in pools
    )


def slot_major(digests: list[np.ndarray]) -> np.ndarray:
    """Per-move digests (groups, outer, blocks) -> (blocks, pieces) in slot order."""
    columns = [d.reshape(-1, d.shape[-1]) for d in digests]
    return np.concatenate(columns, axis=0).T


class PoolLocks:
    """Holds the locks of ``pools`` in the global order transfer uses (by id); a plain loop,
    since an ExitStack costs more right after a model step (decision 0004)."""

    def __init__(self, pools: Sequence[DevicePool]) -> None:
        self._locks = [pool._lock for _, pool in sorted({id(p): p for p in pools}.items())]

    def __enter__(self) -> None:
        taken = []
        try:
            for lock in self._locks:
                lock.acquire()
                taken.append(lock)
        except BaseException:
            for lock in reversed(taken):
                lock.release()
            raise

    def __exit__(self, *exc: object) -> None:
        for lock in reversed(self._locks):
            lock.release()


class KeptPools:
    """What a HostPool keeps between moves with one list of DevicePools (a store's): the
    pools' locks in order and the native plans per direction (see HostPool._kept_plan). It
    holds the pools (its plans would anyway), so their ids name them while it lives: the last
    list moved with stays alive until another one is used or the HostPool closes."""

    def __init__(self, pools: Sequence[DevicePool]) -> None:
        self._pools = tuple(pools)
        self._ids = tuple(map(id, pools))
        self.locks = PoolLocks(pools)
        # each pool once, in order (the donated identity step runs once a pool)
        self.unique: list[DevicePool | TorchPool] = list({id(p): p for p in pools}.values())
        self.devices = [p for p in self.unique if isinstance(p, DevicePool)]  # donated on writes
        self.plans: dict[bool, native.BlockPlan] = {}

    def matches(self, pools: Sequence[Any]) -> bool:
        # by id (the pools it holds cannot die): comparing each pool costs more right after a
        # model step (0004)
        return tuple(map(id, pools)) == self._ids
