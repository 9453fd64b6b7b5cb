"""Where a block's bytes land when they are received straight into their final places instead
of a DRAM slot (:class:`Scatter`), and the places of an engine's own CPU tensors
(:func:`tensor_landing`): a remote tier that can write in place (``get_scattered``) then moves
each block once, from the socket into the engine's KV blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.transfer.slot_moves import PoolLocks
from tpusync.errors import InvalidArgumentError

__all__ = ["Scatter", "still_in_place", "tensor_landing"]


@dataclass(frozen=True)
class Scatter:
    """Where each of a pull's blocks goes, run by run: block ``i``'s runs are ``first[i]`` to
    ``first[i + 1]``; run ``r`` starts at ``offsets[r]`` in the block's payload (a block's
    first run at 0, then rising) and lasts to the next run or the payload's end; it lands at
    address ``targets[r]``, or nowhere when that is 0 (received and hashed, then dropped).

    The caller keeps every target writable until the pull returns, and lets no one read a
    block's places unless the pull reports that block loaded: a block that failed (corrupt,
    missing, cut off) may have written some of them."""

    first: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray

    def checked(self, blocks: int, payload_bytes: int) -> Scatter:
        """Itself as contiguous int64/int64/uint64 arrays, after checking it covers ``blocks``
        payloads of ``payload_bytes``; InvalidArgumentError (naming ``scatter``) otherwise."""
        first = np.ascontiguousarray(self.first, dtype=np.int64)
        offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        targets = np.ascontiguousarray(self.targets, dtype=np.uint64)
        runs = len(offsets)
        if first.shape != (blocks + 1,) or targets.shape != (runs,) or offsets.ndim != 1:
            raise InvalidArgumentError(
                f"scatter: expected first of {blocks + 1} entries (one per key and one more) "
                f"and one target per offset; got {first.shape}, {offsets.shape}, {targets.shape}"
            )
        if first[0] != 0 or first[-1] != runs or (np.diff(first) < 1).any():
            raise InvalidArgumentError(
                "scatter: first must start at 0, rise by at least 1 per key (a run each) and "
                "end at the number of runs"
            )
        starts = np.zeros(runs, dtype=bool)
        starts[first[:-1]] = True
        rising = np.diff(offsets, prepend=np.int64(-1)) > 0
        if runs and (
            (offsets[starts] != 0).any()
            or not rising[~starts].all()
            or offsets.max() >= payload_bytes
        ):
            raise InvalidArgumentError(
                "scatter: each key's runs must start at offset 0 and rise inside its payload "
                f"({payload_bytes} bytes)"
            )
        return Scatter(first, offsets, targets)

    def select(self, blocks: Sequence[int] | np.ndarray) -> Scatter:
        """The runs of ``blocks`` (indices into this scatter's blocks), in that order."""
        blocks = np.asarray(blocks, dtype=np.int64)
        counts = self.first[blocks + 1] - self.first[blocks]
        starts = np.repeat(self.first[blocks] - np.cumsum(counts) + counts, counts)
        picked = starts + np.arange(int(counts.sum()))
        first = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
        return Scatter(first, self.offsets[picked], self.targets[picked])

    def runs_of(self, blocks: np.ndarray, scratch: int) -> tuple[np.ndarray, ...]:
        """The runs of ``blocks`` (in that order), for a receiver: (first, offsets, targets),
        the runs that land nowhere sent to ``scratch`` at their own offset (a payload-sized
        region of the stripe's own)."""
        part = self.select(blocks)
        targets = part.targets.copy()
        nowhere = targets == 0
        targets[nowhere] = np.uint64(scratch) + part.offsets[nowhere].astype(np.uint64)
        return part.first, part.offsets, targets


def tensor_landing(
    layout: PoolLayout, pools: Sequence[Any], block_ids: np.ndarray
) -> Scatter | None:
    """Where each block of ``block_ids`` lands in the memory of ``pools`` (one per array of
    ``layout``), piece by piece in payload order, or None when a pool is not a CPU
    :class:`~tpusync._src.memory.TorchPool` still at its address or a piece is not contiguous in its
    tensor (the caller then stages through DRAM). Read under the pools' locks, which also
    refuse blocks a save holds (``BlocksHeldError``); the locks are not kept while the bytes
    arrive, so a receive never stalls the engine's other transfers: the caller checks
    :func:`still_in_place` afterwards."""
    if len(pools) != len(layout.arrays) or not all(isinstance(p, TorchPool) for p in pools):
        return None
    ids = np.asarray(block_ids, dtype=np.int64)
    with PoolLocks(pools):
        bases, steps = [], []
        for pool, array in zip(pools, layout.arrays, strict=True):
            piece = _piece_places(pool, array.block_axis, array.np_dtype.itemsize)
            if piece is None or array.n_shards != 1 or len(piece[0]) != array.pieces:
                return None
            pool.check_writable(ids, array.block_axis, "device_block_ids")
            bases.append(piece[0])
            steps.append(np.full(len(piece[0]), piece[1], dtype=np.int64))
    base, step = np.concatenate(bases), np.concatenate(steps)
    piece_offsets = layout.piece_table[0]
    targets = (base[None, :] + ids[:, None] * step[None, :]).reshape(-1).astype(np.uint64)
    first = np.arange(0, len(ids) * len(base) + 1, len(base), dtype=np.int64)
    return Scatter(first, np.tile(piece_offsets, len(ids)), targets)


def still_in_place(pools: Sequence[Any]) -> bool:
    """Whether every pool's tensor still has the memory :func:`tensor_landing` read (a tensor
    resized or re-pointed meanwhile got none of the bytes: they are not reported loaded)."""
    return all(pool.in_place() for pool in pools)


def _piece_places(pool: TorchPool, block_axis: int, itemsize: int) -> tuple[np.ndarray, int] | None:
    """The addresses of block 0's contiguous pieces in ``pool``'s tensor (one per index of the
    axes before ``block_axis``, in C order) and the bytes from one block to the next; None
    when the axes after the block axis are not contiguous (a piece would be strided)."""
    if not pool.in_place():
        return None
    tensor = pool.tensor
    shape, strides = tuple(tensor.shape), tuple(tensor.stride())
    want = 1
    inner = zip(shape[block_axis + 1 :], strides[block_axis + 1 :], strict=True)
    for n, stride in reversed(list(inner)):
        if n != 1 and stride != want:
            return None
        want *= n
    outer = np.zeros(1, dtype=np.int64)
    for n, stride in zip(shape[:block_axis], strides[:block_axis], strict=True):
        outer = (outer[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).reshape(-1)
    return tensor.data_ptr() + outer * itemsize, strides[block_axis] * itemsize
