"""Dtype changes on the way in: a subscriber's target may take a float leaf in another float
dtype than the publisher's. The published bytes land first in a landing area
(:class:`Landing`), are verified there against the manifest like every other byte, and are then
converted into the target's shards by the native ``convert`` (GIL released), bit for bit
XLA's convert (``jnp.astype``): float32 and bfloat16 to each other, and to fp8 (``float8_e4m3fn``,
``float8_e5m2``).

An fp8 leaf needs a scale: the publisher sends each float leaf's absolute maxima per channel
(its last axis; ``Publisher(amax=True)``), and the subscriber makes, per tensor (the maximum of
them) or per channel, in float32, ``scale = amax / max`` and ``factor = max / amax`` (``max``:
the fp8 type's largest finite value; both 1 where ``amax`` is 0; where the quotient
overflows, for a tiny ``amax``, ``factor`` is float32's largest and ``scale = 1 / factor``).
The leaf is ``astype(x.astype(float32) * factor, fp8)`` — a multiplication, because XLA
divides by multiplying with the reciprocal, so a quotient would not be bit for bit its own —
and ``scale`` is what dequantizes it (``x ~ q * scale``; :attr:`Subscriber.scales`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tpusync._native.convert import KINDS, SOURCES
from tpusync._src.weights.manifest import LeafEntry
from tpusync.errors import DtypeMismatchError, InvalidArgumentError, WeightSyncError

__all__ = ["FP8", "SCALES", "Landing", "check_scales", "converts", "fp8_scales"]

FP8 = ("float8_e4m3fn", "float8_e5m2")
SCALES = ("tensor", "channel")
_ALIGN = 64


def check_scales(value: object) -> str:
    if value not in SCALES:
        raise InvalidArgumentError(
            f"fp8_scales: expected 'tensor' (one scale per leaf) or 'channel' (one per last-axis "
            f"channel), got {value!r}"
        )
    return str(value)


def converts(path: str, entry: LeafEntry, target: np.dtype, version: int) -> bool:
    """Whether ``entry`` (of ``version``) lands converted in a target leaf of dtype ``target``
    (False: as it is, or it has no bytes); DtypeMismatchError naming the leaf and what would
    work when it cannot."""
    if entry.np_dtype == target:
        return False
    if entry.dtype not in SOURCES or target.name not in KINDS:
        raise DtypeMismatchError(
            f"target{path}: dtype {target.name}, published {entry.dtype}; a leaf is converted "
            f"on the way in only from {' or '.join(SOURCES)} to {', '.join(KINDS)}: give the "
            "target the published dtype"
        )
    if target.name in FP8 and entry.amax is None:
        raise DtypeMismatchError(
            f"target{path}: {target.name} needs a scale, and version {version}'s publisher "
            "sends no maxima to make it from: publish with Publisher(amax=True), or take the "
            f"leaf as {entry.dtype}"
        )
    return math.prod(entry.shape) > 0


def fp8_scales(
    path: str, amax: np.ndarray, dtype: np.dtype, per: str
) -> tuple[np.ndarray, np.ndarray]:
    """``(scale, factor)`` of a leaf taken as the fp8 ``dtype`` from its published per-channel
    maxima ``amax``: one each (shape ``()``) per tensor, or one per channel."""
    if not np.isfinite(amax).all():
        raise WeightSyncError(
            f"target{path}: the published leaf holds values that are not finite (an absolute "
            f"maximum of {amax[~np.isfinite(amax)][0]}); it has no {dtype.name} scale"
        )
    top = np.float32(ml_dtypes.finfo(dtype).max)
    amax = np.asarray(amax.max() if per == "tensor" else amax, dtype=np.float32)
    held = np.where(amax > 0, amax, np.float32(1))
    scale = np.where(amax > 0, held / top, np.float32(1)).astype(np.float32)
    with np.errstate(over="ignore", divide="ignore"):
        factor = (top / held).astype(np.float32)
        # a tiny amax: the largest factor float32 has, and the scale that undoes it
        clamped = ~np.isfinite(factor)
        factor = np.where(clamped, np.finfo(np.float32).max, factor).astype(np.float32)
        scale = np.where(clamped, np.float32(1) / factor, scale).astype(np.float32)
    return scale, np.where(amax > 0, factor, np.float32(1)).astype(np.float32)


@dataclass(frozen=True)
class Landing:
    """Where a pull's converted leaves land before their conversion: for each (leaf, device)
    of a first replica, its shard in the published dtype; for each fp8 leaf, its maxima."""

    shards: dict[tuple[int, int], int]
    maxima: dict[int, int]
    nbytes: int

    @classmethod
    def plan(
        cls, entries: tuple[LeafEntry, ...], shard_bytes: dict[tuple[int, int], int], fp8: set[int]
    ) -> Landing:
        """``shard_bytes[(leaf, device)]``: each converted first replica's published bytes;
        ``fp8``: the leaves taken as fp8."""
        at = 0
        shards, maxima = {}, {}
        for key, nbytes in shard_bytes.items():
            shards[key] = at
            at += -(-nbytes // _ALIGN) * _ALIGN
        for leaf in sorted(fp8):
            maxima[leaf] = at
            at += -(-4 * entries[leaf].channels // _ALIGN) * _ALIGN
        return cls(shards, maxima, at)
