"""The engine interface and the planned batch every engine runs.

A batch is a list of :class:`Move`: validated (source, destination) pairs whose sides are a
:class:`DeviceSide` (a ``jax.Array`` or :class:`~tpusync.DevicePool`, cut into its distinct
addressable shards) or a :class:`HostSide` (strided numpy views, one per shard group). The
transfer layer (:mod:`tpusync.transfer`) builds them, asks each engine why it cannot run them
(:meth:`Engine.unavailable`), chooses one (:mod:`tpusync._src.transfer.select`, the only place that
chooses) and runs it; an engine never chooses and never imports the chooser.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import numpy as np

from tpusync._src.memory.device_pool import DevicePool, current_array

__all__ = ["DeviceSide", "Engine", "HostSide", "Move", "ShardGroup", "Side"]

IndexKey = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ShardGroup:
    """One distinct shard of a device array: its index key and the devices holding a replica
    (the first is the one read from)."""

    key: IndexKey
    devices: tuple[Any, ...]


@dataclass
class DeviceSide:
    argument: str
    given: jax.Array | None  # a plain array; None for a pool, whose array is read from it
    pool: DevicePool | None
    shard_shape: tuple[int, ...]
    groups: tuple[ShardGroup, ...]

    @property
    def array(self) -> jax.Array:
        """The side's array now: a pool's current one (its shape, dtype and sharding are
        fixed). A side holds no reference to a pool's array, which would keep a
        ``donated_steps`` pool from being written in place."""
        if self.pool is not None:
            return current_array(self.pool)
        assert self.given is not None
        return self.given

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.array.dtype)

    @property
    def ndim(self) -> int:
        return len(self.shard_shape)


@dataclass
class HostSide:
    argument: str
    views: list[np.ndarray] = field(default_factory=list)  # one per shard group, same ndim
    pool: Any = None  # the TorchPool the views are of (its lock and held blocks), or None

    @property
    def dtype(self) -> np.dtype:
        return self.views[0].dtype

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return self.views[0].shape


Side = DeviceSide | HostSide


@dataclass
class Move:
    """One validated (source, destination) pair: src_blocks[i] -> dst_blocks[i]."""

    src: Side
    dst: Side
    src_blocks: np.ndarray
    dst_blocks: np.ndarray
    block_axis: int
    whole: bool  # every block to the same index: a whole-array copy

    @property
    def block_nbytes(self) -> int:
        shape = self.src.shard_shape
        return int(np.prod(shape[self.block_axis + 1 :], dtype=np.int64)) * self.src.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes delivered to the destination (every replica and outer piece counted)."""
        shape = self.src.shard_shape
        outer = int(np.prod(shape[: self.block_axis], dtype=np.int64))
        copies = sum(
            len(g.devices) if isinstance(self.dst, DeviceSide) else 1 for g in self.groups()
        )
        return outer * len(self.src_blocks) * self.block_nbytes * copies

    def groups(self) -> tuple[ShardGroup, ...]:
        for side in (self.src, self.dst):
            if isinstance(side, DeviceSide):
                return side.groups
        return (ShardGroup((), ()),) * len(self.src.views)  # type: ignore[union-attr]

    def pools(self) -> list[Any]:
        """The pools the move touches (DevicePools, TorchPools): their locks are held while it
        runs."""
        return [s.pool for s in (self.src, self.dst) if s.pool is not None]


class Engine(Protocol):
    """One way to move a planned batch: the native engine (raw memory on the CPU backend, the
    PJRT C API on plugin backends) or pure JAX. Adding one is a new module with an object of
    this shape and one entry in :mod:`tpusync._src.transfer.select`."""

    name: str  # what TransferFuture.path and info() say: "native", "jax"

    def unavailable(self, move: Move, *, explicit: bool) -> list[str]:
        """Why this engine cannot run ``move``, one reason per side that it cannot serve, each
        starting with the side's argument name (``"dst: ..."``); empty where it can.
        ``explicit``: the caller asked for this engine by name (it may then use what
        ``path="auto"`` would not pick yet)."""
        ...

    def run(self, moves: list[Move]) -> int:
        """Moves every pair and returns the bytes delivered; the pools' locks are held by the
        caller."""
        ...
