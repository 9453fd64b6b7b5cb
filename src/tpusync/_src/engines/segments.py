"""Byte-segment plans: where a side's blocks live in memory, and the (src, dst, nbytes) rows
that move them. Pure address arithmetic, no data movement; the native engine runs the rows."""

from __future__ import annotations

import numpy as np

from tpusync._native import core as _core

__all__ = ["Region", "block_bytes", "c_strides", "segments", "strided_offsets"]


def strided_offsets(shape: tuple[int, ...], strides: tuple[int, ...], axis: int) -> np.ndarray:
    """Byte offsets of every index combination over axes [0, axis), row-major."""
    offsets = np.zeros(1, dtype=np.int64)
    for n, stride in zip(shape[:axis], strides[:axis], strict=True):
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64)[None, :] * stride).ravel()
    return offsets


def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The strides (bytes) of a C-ordered array of ``shape``."""
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
