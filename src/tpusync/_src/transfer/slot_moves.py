"""Moves between device pools and a host pool's slots, returning each block's checksum over the
bytes moved: the hallway a DRAM tier's save and load take (tiers -> transfer -> engines).

A :class:`SlotMover` belongs to one host pool. For the last list of device pools it moved with
(an engine's, the same list every step) it keeps the pools' locks in order and the native plans
per direction (:class:`KeptPools`), so that a step pays no validation or planning (decision
0004); other arrays take the general path of :func:`~tpusync._src.transfer.transfer_batch`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tpusync._src.engines import native
from tpusync._src.memory.device_pool import DevicePool, lock_of, start_donation, wait_for_readers
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.transfer.api import pools_locked, transfer_batch
from tpusync._src.transfer.plan import Transfer, plan_move
from tpusync._src.transfer.select import choose_engine

__all__ = ["KeptPools", "PoolLocks", "SlotMover", "native_ready"]


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


def _slot_major(digests: list[np.ndarray]) -> np.ndarray:
    """Per-move digests (groups, outer, blocks) -> (blocks, pieces) in slot order."""
    columns = [d.reshape(-1, d.shape[-1]) for d in digests]
    return np.concatenate(columns, axis=0).T


class PoolLocks:
    """Holds the locks of ``pools`` in the global order transfer uses (by id); a plain loop,
    since an ExitStack costs more right after a model step (decision 0004)."""

    def __init__(self, pools: Sequence[DevicePool | TorchPool]) -> None:
        self._locks = [lock_of(pool) for _, pool in sorted({id(p): p for p in pools}.items())]

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
    """What a mover keeps between moves with one list of device pools: the pools' locks in
    order and the native plans per direction. It holds the pools (its plans would anyway), so
    their ids name them while it lives: the last list moved with stays alive until another one
    is used or the mover forgets it."""

    def __init__(self, pools: Sequence[DevicePool | TorchPool]) -> None:
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


class SlotMover:
    """Moves blocks between device pools (one per array of a layout) and a host pool's slots.

    Args:
      views: each array's part of every slot, as strided host arrays (the pool's
        ``views()``; called when a move is planned).
      block_axes: each array's block axis.
      hash_slots: each slot's block checksum from its bytes in memory (the JAX path's pass).
      block_checksums: a block's checksum from its pieces' checksums, (blocks, pieces) ->
        (blocks,) (the native path hashes each piece as it copies it).
    """

    def __init__(
        self,
        views: Callable[[], list[np.ndarray]],
        block_axes: Sequence[int],
        hash_slots: Callable[[np.ndarray], np.ndarray],
        block_checksums: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        self._views = views
        self._block_axes = list(block_axes)
        self._hash_slots = hash_slots
        self._block_checksums = block_checksums
        self._kept: KeptPools | None = None  # for the last list of pools moved with

    def move(
        self,
        pools: Sequence[Any],
        block_ids: np.ndarray,
        slots: np.ndarray,
        path: str,
        *,
        to_device: bool,
        after: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """Moves device blocks ``block_ids`` to or from ``slots`` (one move per array) and
        returns the blocks' checksums over the bytes moved: computed in the copy pass on the
        native path, in a separate pass over the (pinned or reserved) slots on the JAX path.
        ``after(i)``: called once array ``i`` is moved (array by array on the kept native
        plan, all at the end otherwise)."""
        kept = self._kept_for(pools) if path != "jax" else None
        if kept is not None:  # DevicePools or TorchPools only
            with kept.locks:
                if to_device:  # its wait overlaps the checks below
                    start_donation(kept.devices)
                # planning reads buffer addresses: native pools only
                if native_ready(pools, write=to_device):
                    plan = self._plan(kept, pools, to_device)
                    if to_device:  # what validation would check, had it run for this call
                        for pool, axis in zip(pools, self._block_axes, strict=True):
                            pool.check_writable(block_ids, axis, "block_ids")
                    src, dst = (slots, block_ids) if to_device else (block_ids, slots)
                    return native.run_hashed_plan(
                        plan, src, dst, donated=to_device, after_move=after
                    )
        checksums = self._move_unplanned(pools, block_ids, slots, path, to_device)
        for i in range(len(pools) if after is not None else 0):
            after(i)  # type: ignore[misc]
        return checksums

    def prepare(self, pools: Sequence[DevicePool | TorchPool]) -> list[DevicePool]:
        """Plans the native moves with ``pools`` in both directions, starts the copy engine
        and waits for the DevicePools' readers (compiling their donated identity step); returns
        those DevicePools."""
        kept = self._kept_for(pools)
        assert kept is not None  # DevicePools or TorchPools: the caller checked
        with kept.locks:
            for to_device in (True, False):
                if native_ready(pools, write=to_device):
                    native.engine()
                    self._plan(kept, pools, to_device)
            wait_for_readers(kept.devices)
        return kept.devices

    def forget(self) -> None:
        """Drops the kept pools and plans (their plans hold views of the slots)."""
        self._kept = None

    def _move_unplanned(
        self,
        pools: Sequence[Any],
        block_ids: np.ndarray,
        slots: np.ndarray,
        path: str,
        to_device: bool,
    ) -> np.ndarray:
        items = []
        for pool, view, axis in zip(pools, self._views(), self._block_axes, strict=True):
            if to_device:
                items.append(Transfer(view, pool, slots, block_ids, axis))
            else:
                items.append(Transfer(pool, view, block_ids, slots, axis))
        moves = [plan_move(item) for item in items]
        if choose_engine(moves, path).name == "native":
            with pools_locked(moves):
                digests = native.run_hashed(moves)
            return self._block_checksums(_slot_major(digests))
        if to_device:
            checksums = self._hash_slots(slots)  # pinned: what is hashed is what moves
            transfer_batch(items, path="jax").result()
            return checksums
        transfer_batch(items, path="jax").result()
        return self._hash_slots(slots)

    def _kept_for(self, pools: Sequence[Any]) -> KeptPools | None:
        """What is kept for moves with ``pools`` (the same list as last time, usually); None
        unless they are all DevicePools or TorchPools (nothing is kept for other arrays, nor
        are they held)."""
        kept = self._kept
        if kept is not None and kept.matches(pools):
            return kept
        if not all(isinstance(pool, DevicePool | TorchPool) for pool in pools):
            return None
        kept = self._kept = KeptPools(pools)
        return kept

    def _plan(
        self, kept: KeptPools, pools: Sequence[DevicePool | TorchPool], to_device: bool
    ) -> native.BlockPlan:
        """The validated moves between ``pools`` (those ``kept`` is for) and the slot views,
        planned for the native engine: validation (endpoints, shapes, dtypes, shards) and
        planning run once per list of device pools and direction, since a DevicePool's shape,
        dtype and sharding never change and the slot views are fixed. Call with the pools
        locked and native-ready."""
        plan = kept.plans.get(to_device)
        if plan is None:
            # No blocks: validation must not depend on (or race with) which blocks a save
            # holds right now; the call's own blocks are checked by the caller.
            none = np.zeros(0, dtype=np.int64)
            moves = []
            for pool, view, axis in zip(pools, self._views(), self._block_axes, strict=True):
                if to_device:
                    item = Transfer(view, pool, none, none, axis)
                else:
                    item = Transfer(pool, view, none, none, axis)
                moves.append(plan_move(item))
            plan = kept.plans[to_device] = native.BlockPlan(moves)
        return plan
