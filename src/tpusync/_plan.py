"""Block lists and byte-segment plans: pure index arithmetic, no data movement."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tpusync.errors import BlockIndexError, InvalidArgumentError

BlockList = Sequence[int] | np.ndarray | range | None


def block_indices(blocks: BlockList, num_blocks: int, argument: str) -> np.ndarray | None:
    """Validates a block list; returns it as int64, or None for "all blocks"."""
    if blocks is None:
        return None
    if isinstance(blocks, range):
        array = np.arange(blocks.start, blocks.stop, blocks.step, dtype=np.int64)
    else:
        try:
            array = np.asarray(blocks)
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"{argument}: expected a sequence of block indices, got {type(blocks).__name__}"
            ) from exc
        if array.size == 0:
            array = array.astype(np.int64)
        if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
            raise InvalidArgumentError(
                f"{argument}: block indices must be integers, got dtype {array.dtype}"
            )
        if array.ndim != 1:
            raise InvalidArgumentError(
                f"{argument}: expected a flat list of block indices, got shape {array.shape}"
            )
        array = array.astype(np.int64, copy=False)
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < 0 or high >= num_blocks:
            bad = low if low < 0 else high
            raise BlockIndexError(
                f"{argument}: block index {bad} is out of range for {num_blocks} blocks "
                f"(valid: 0..{num_blocks - 1})"
            )
    return array


def pair_block_lists(
    src_blocks: BlockList, dst_blocks: BlockList, src_count: int, dst_count: int
) -> tuple[np.ndarray, np.ndarray]:
    """Validates both lists and returns them explicitly, equal in length."""
    src = block_indices(src_blocks, src_count, "src_blocks")
    dst = block_indices(dst_blocks, dst_count, "dst_blocks")
    if src is None:
        src = np.arange(src_count, dtype=np.int64)
    if dst is None:
        dst = np.arange(dst_count, dtype=np.int64)
    if len(src) != len(dst):
        what = "blocks" if src_blocks is None and dst_blocks is None else "block lists"
        raise InvalidArgumentError(
            f"dst_blocks: {len(dst)} destination {what} for {len(src)} source {what}; "
            "src_blocks[i] goes to dst_blocks[i], so both need the same length"
        )
    if len(dst) > 1:
        counts = np.bincount(dst)  # indices are in range and non-negative by now
        if counts.max() > 1:
            raise BlockIndexError(
                f"dst_blocks: destination block {int(np.argmax(counts > 1))} appears more "
                "than once; each destination block may be written once per transfer"
            )
    return src, dst


def is_identity(src: np.ndarray, dst: np.ndarray, src_count: int, dst_count: int) -> bool:
    """True when the transfer moves every block to the same index (a whole-array copy)."""
    n = len(src)
    return (
        n == src_count == dst_count
        and bool(np.array_equal(src, np.arange(n)))
        and bool(np.array_equal(dst, src))
    )


def strided_offsets(shape: tuple[int, ...], strides: tuple[int, ...], axis: int) -> np.ndarray:
    """Byte offsets of every index combination over axes [0, axis), row-major."""
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(shape[:axis], strides[:axis], strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).ravel()
    return offsets


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides = []
    step = itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Region:
    """Where a side's blocks live in memory: a base address plus strides (bytes)."""

    __slots__ = ("base", "shape", "strides")

    def __init__(self, base: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.base = base
        self.shape = shape
        self.strides = strides

    @classmethod
    def of_array(cls, array: np.ndarray) -> Region:
        return cls(array.ctypes.data, array.shape, array.strides)

    @classmethod
    def contiguous(cls, address: int, shape: tuple[int, ...], itemsize: int) -> Region:
        return cls(address, shape, c_strides(shape, itemsize))


def block_bytes(shape: tuple[int, ...], itemsize: int, block_axis: int) -> int:
    return int(np.prod(shape[block_axis + 1 :], dtype=np.int64)) * itemsize


def segments(
    src: Region,
    dst: Region,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    block_axis: int,
    itemsize: int,
    merge: bool = True,
) -> np.ndarray:
    """Rows (src_address, dst_address, nbytes) for moving src_blocks[i] -> dst_blocks[i], in
    (outer index, block) order; with ``merge``, neighbours that are contiguous on both sides
    become one row (hashed copies keep one row per piece instead)."""
    from tpusync import _core

    nbytes = block_bytes(src.shape, itemsize, block_axis)
    if nbytes == 0 or len(src_blocks) == 0:
        return np.empty((0, 3), dtype=np.uint64)
    src_outer = src.base + strided_offsets(src.shape, src.strides, block_axis)
    dst_outer = dst.base + strided_offsets(dst.shape, dst.strides, block_axis)
    return _core.block_segments(
        src_outer,
        src.strides[block_axis],
        dst_outer,
        dst.strides[block_axis],
        np.ascontiguousarray(src_blocks, dtype=np.int64),
        np.ascontiguousarray(dst_blocks, dtype=np.int64),
        nbytes,
        merge,
    )
