"""The reshard plan of one array: which part of which source shard each target shard needs.

A sharded array's shards are index boxes of its global shape (``sharding.devices_indices_map``);
replicas share a box. A target shard's box intersects some source boxes; each intersection is a
:class:`Piece`, a box in both shards' local coordinates. A piece is read from the source shard's
bytes (C order) as equal-length runs (:meth:`Piece.source_offsets`), so a puller fetches only
the bytes its own shards need.

Plans depend only on the global shape, the item size and the two sets of boxes, so they are
computed once per pair of layouts and cached (:func:`leaf_plan`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync.errors import InvalidArgumentError

__all__ = ["Box", "LeafPlan", "Piece", "leaf_plan", "shard_boxes"]

# a box: per dimension (start, stop), in global coordinates
Box = tuple[tuple[int, int], ...]


def _box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    out = []
    for dim, part in zip(shape, index, strict=True):
        start, stop, step = part.indices(dim)
        if step != 1:
            raise InvalidArgumentError(f"sharding: a shard with stride {step} is not a box")
        out.append((start, stop))
    return tuple(out)


def shard_boxes(sharding: Any, shape: tuple[int, ...]) -> tuple[tuple[Box, ...], dict[Any, int]]:
    """The distinct index boxes of ``sharding`` over an array of ``shape`` (in the order of
    their first device in ``sharding``'s device order) and, per device, the index of its box
    (replicas share one)."""
    shape = tuple(int(d) for d in shape)
    try:
        indices = sharding.devices_indices_map(shape)
    except (AttributeError, TypeError, ValueError) as error:
        raise InvalidArgumentError(
            f"sharding: cannot place an array of shape {shape} ({error})"
        ) from None
    boxes: list[Box] = []
    where: dict[Box, int] = {}
    of_device: dict[Any, int] = {}
    for device, index in indices.items():
        box = _box_of(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape)
        if box not in where:
            where[box] = len(boxes)
            boxes.append(box)
        of_device[device] = where[box]
    return tuple(boxes), of_device


@dataclass(frozen=True)
class Piece:
    """Part of target shard ``target`` that lies in source shard ``source``: ``source_box`` in
    the source shard's local coordinates, ``target_box`` in the target shard's (both the same
    extent)."""

    source: int
    target: int
    source_box: Box
    target_box: Box
    source_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    itemsize: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.source_box)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def source_offsets(self) -> tuple[np.ndarray, int]:
        """Every run of the piece in the source shard: (byte offsets, bytes a run)."""
        return _runs(self.source_box, self.source_shape, self.itemsize)

    def target_offsets(self) -> tuple[np.ndarray, int]:
        """Every run of the piece in the target shard: (byte offsets, bytes a run)."""
        return _runs(self.target_box, self.target_shape, self.itemsize)

    def runs(self) -> tuple[np.ndarray, np.ndarray, int]:
        """The piece as runs contiguous in both shards: (offsets in the source shard, offsets
        in the target shard, bytes a run). Each side's runs are cut to the shorter of the two
        (one always divides the other: each is the piece's trailing extent from some axis on)."""
        src, src_run = self.source_offsets()
        dst, dst_run = self.target_offsets()
        run = min(src_run, dst_run)
        if src_run > run:
            src = (src[:, None] + np.arange(0, src_run, run, dtype=np.int64)[None, :]).reshape(-1)
        if dst_run > run:
            dst = (dst[:, None] + np.arange(0, dst_run, run, dtype=np.int64)[None, :]).reshape(-1)
        return src, dst, run


def _runs(box: Box, shape: tuple[int, ...], itemsize: int) -> tuple[np.ndarray, int]:
    """Byte offsets of the contiguous runs of ``box`` within a C-order array of ``shape``, and
    the bytes of each run."""
    ndim = len(shape)
    if ndim == 0:
        return np.zeros(1, dtype=np.int64), itemsize
    # the trailing dimensions the box covers whole join the run, and so does the first one
    # it does not
    k = ndim - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1 :]) * itemsize
    run = (box[k][1] - box[k][0]) * inner
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(ndim)]
    first = sum(box[d][0] * strides[d] for d in range(ndim))
    outer = [np.arange(box[d][1] - box[d][0], dtype=np.int64) * strides[d] for d in range(k)]
    if not outer:
        return np.array([first], dtype=np.int64), run
    grid = np.zeros(1, dtype=np.int64)
    for axis in outer:
        grid = (grid[:, None] + axis[None, :]).reshape(-1)
    return first + grid, run


@dataclass(frozen=True)
class LeafPlan:
    """The plan of one array: its source and target boxes and, per target shard, its pieces
    (they tile the target box exactly)."""

    shape: tuple[int, ...]
    itemsize: int
    source_boxes: tuple[Box, ...]
    target_boxes: tuple[Box, ...]
    pieces: tuple[tuple[Piece, ...], ...]  # per target box

    def bytes_from(self, source: int) -> int:
        """Bytes the targets need from source shard ``source``."""
        return sum(p.nbytes for per in self.pieces for p in per if p.source == source)


def _check_boxes(boxes: Any, shape: tuple[int, ...], argument: str) -> tuple[Box, ...]:
    out = []
    for i, box in enumerate(boxes):
        box = tuple((int(a), int(b)) for a, b in box)
        if len(box) != len(shape) or any(
            not 0 <= a < b <= d for (a, b), d in zip(box, shape, strict=True)
        ):
            raise InvalidArgumentError(
                f"{argument}[{i}]: {box} is not a non-empty box of shape {shape}"
            )
        out.append(box)
    if not out:
        raise InvalidArgumentError(f"{argument}: no boxes")
    covered = sum(math.prod(b - a for a, b in box) for box in set(out))
    if covered != math.prod(shape) and math.prod(shape):
        raise InvalidArgumentError(
            f"{argument}: the boxes cover {covered} of the array's {math.prod(shape)} "
            "elements; give every distinct shard once"
        )
    return tuple(out)


def leaf_plan(
    shape: tuple[int, ...], itemsize: int, source_boxes: Any, target_boxes: Any
) -> LeafPlan:
    """The plan that fills each target box of an array of ``shape`` (``itemsize`` bytes an
    element) from the source boxes (each distinct shard once; see :func:`shard_boxes`).
    Cached: the same layouts give the same plan object."""
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape) or int(itemsize) < 1:
        raise InvalidArgumentError(f"shape: {shape} with itemsize {itemsize} is not an array")
    source = _check_boxes(source_boxes, shape, "source_boxes")
    target = _check_boxes(target_boxes, shape, "target_boxes")
    return _cached_plan(shape, int(itemsize), source, target)


@functools.lru_cache(maxsize=4096)
def _cached_plan(
    shape: tuple[int, ...], itemsize: int, source: tuple[Box, ...], target: tuple[Box, ...]
) -> LeafPlan:
    per_target = []
    for t, tbox in enumerate(target):
        pieces = []
        for s, sbox in enumerate(source):
            inter = tuple(
                (max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(sbox, tbox, strict=True)
            )
            if any(a >= b for a, b in inter):
                continue
            pieces.append(
                Piece(
                    source=s,
                    target=t,
                    source_box=tuple(
                        (a - o, b - o) for (a, b), (o, _) in zip(inter, sbox, strict=True)
                    ),
                    target_box=tuple(
                        (a - o, b - o) for (a, b), (o, _) in zip(inter, tbox, strict=True)
                    ),
                    source_shape=tuple(b - a for a, b in sbox),
                    target_shape=tuple(b - a for a, b in tbox),
                    itemsize=itemsize,
                )
            )
        per_target.append(tuple(pieces))
    return LeafPlan(shape, itemsize, source, target, tuple(per_target))
