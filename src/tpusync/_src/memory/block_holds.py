"""Blocks a save still reads: counted holds per block axis, which transfers must not write.

One rule for every pool tpusync writes (:class:`~tpusync.DevicePool`, ``TorchPool``): a
transfer whose destination blocks include a held one raises
:class:`~tpusync.errors.BlocksHeldError` and changes nothing."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from tpusync.errors import BlockIndexError, BlocksHeldError, InvalidArgumentError

__all__ = ["BlockHolds"]


class BlockHolds:
    """Hold counts for the blocks of a pool of ``shape`` called ``name`` (in errors)."""

    def __init__(self, shape: tuple[int, ...], name: str) -> None:
        self.shape = shape
        self.name = name
        self._lock = threading.Lock()
        self._counts: dict[int, np.ndarray] = {}
        self._total: dict[int, int] = {}

    def block_ids(self, block_ids: Any, block_axis: Any) -> np.ndarray:
        """``block_ids`` as int64, each a block of ``block_axis`` (checked)."""
        if type(block_axis) is not int or not 0 <= block_axis < len(self.shape):
            raise InvalidArgumentError(
                f"block_axis: expected an axis of the pool's {len(self.shape)}, got {block_axis!r}"
            )
        ids = np.asarray(block_ids)
        if ids.size and ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"block_ids: expected integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        n = self.shape[block_axis]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            raise BlockIndexError(
                f"block_ids: {int(ids.min())}..{int(ids.max())} is outside the pool's blocks "
                f"0..{n - 1} on axis {block_axis}"
            )
        return ids

    def hold(self, block_ids: Any, block_axis: int = 0) -> None:
        """One more hold on each block (each hold is released once)."""
        ids = self.block_ids(block_ids, block_axis)
        with self._lock:
            counts = self._counts.get(block_axis)
            if counts is None:
                counts = self._counts[block_axis] = np.zeros(self.shape[block_axis], np.int64)
            np.add.at(counts, ids, 1)
            self._total[block_axis] = self._total.get(block_axis, 0) + len(ids)

    def release(self, block_ids: Any, block_axis: int = 0) -> None:
        """One hold less on each block; a block without a hold stays without one."""
        ids = self.block_ids(block_ids, block_axis)
        with self._lock:
            counts = self._counts.get(block_axis)
            if counts is None:
                return
            np.subtract.at(counts, ids, 1)
            np.maximum(counts, 0, out=counts)
            self._total[block_axis] = int(counts.sum())

    def held(self, block_axis: int = 0) -> list[int]:
        """The held blocks (sorted)."""
        with self._lock:
            counts = self._counts.get(block_axis)
            return [] if counts is None else np.flatnonzero(counts).tolist()

    def check_writable(self, block_ids: np.ndarray, block_axis: int, argument: str) -> None:
        """Raises BlocksHeldError when ``block_ids`` (checked against the pool) include a held
        block."""
        if not self._total.get(block_axis):  # nothing held: the usual case, no lock
            return
        with self._lock:
            counts = self._counts[block_axis]
            ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
            busy = np.unique(ids[counts[ids] > 0]).tolist()
        if busy:
            raise BlocksHeldError(
                f"{argument}: blocks {busy[:8]}{'...' if len(busy) > 8 else ''} of pool "
                f"{self.name!r} are still being saved; wait for the save's `released` future "
                "before writing them"
            )
