"""PoolLayout: what one block is, and where each array's part of it sits in a slot.

A block spans every array of a device pool (per layer, K and V together or apart, any block
axis). A slot in any tier holds one block of every array, laid out ``[array][shard][outer][inner]``
(``outer`` are the axes before the block axis, ``inner`` the ones after), so the slots seen
through one array's eyes form a strided host array that :func:`tpusync.transfer` fills or reads in
one call. The layout's fingerprint names the block format; tiers refuse blocks of another one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import numpy as np

from tpusync._src.engines.segments import c_strides
from tpusync._src.memory.device_pool import DevicePool
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.transfer.endpoints import resolve_device
from tpusync.errors import InvalidArgumentError, PoolFormatError

__all__ = ["ArrayLayout", "PoolLayout"]

SLOT_ALIGNMENT = 4096  # slots start on page boundaries: O_DIRECT and DMA both want that

# Bounds on a described layout (far above any real model's), so that a damaged or hostile
# description can neither make numbers that overflow the formats nor ask for huge tables.
_MAX_ARRAYS = 1 << 16
_MAX_DIMS = 32
_MAX_DIM = 1 << 32
_MAX_SHARDS = 1 << 20
_MAX_BLOCK_BYTES = 1 << 44
_MAX_TEXT = 1024
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


@dataclass(frozen=True)
class ArrayLayout:
    """One array's part of a block.

    Attributes:
      name: a label (e.g. ``"layer3.k"``).
      dtype: numpy dtype name.
      shard_block_shape: one shard's shape with the block axis removed.
      block_axis: the axis of the device array that indexes blocks.
      n_shards: distinct addressable shards (the host side's leading ``[shard]`` axis).
    """

    name: str
    dtype: str
    shard_block_shape: tuple[int, ...]
    block_axis: int
    n_shards: int

    @property
    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype)

    @property
    def outer_shape(self) -> tuple[int, ...]:
        return self.shard_block_shape[: self.block_axis]

    @property
    def inner_shape(self) -> tuple[int, ...]:
        return self.shard_block_shape[self.block_axis :]

    @property
    def piece_bytes(self) -> int:
        """Bytes of one contiguous piece: the inner axes of one outer index of one shard."""
        return math.prod(self.inner_shape) * self.np_dtype.itemsize

    @property
    def pieces(self) -> int:
        """Contiguous pieces of this array in one slot."""
        return self.n_shards * math.prod(self.outer_shape)

    @property
    def block_bytes(self) -> int:
        return self.pieces * self.piece_bytes


@dataclass(frozen=True)
class PoolLayout:
    """The block format shared by a device pool and every tier that holds its blocks.

    Args:
      model_id: names the model (and anything else that makes KV incompatible); part of the
        fingerprint.
      arrays: each array's part of a block, in slot order.
    """

    model_id: str
    arrays: tuple[ArrayLayout, ...]

    FORMAT_VERSION = 1

    def __post_init__(self) -> None:
        if not self.arrays:
            raise InvalidArgumentError("arrays: a layout needs at least one array")
        if len({a.name for a in self.arrays}) != len(self.arrays):
            raise InvalidArgumentError("arrays: array names must be unique")

    @classmethod
    def from_pools(
        cls,
        model_id: str,
        pools: Sequence[DevicePool | jax.Array | TorchPool],
        *,
        block_axis: int = 0,
        names: Sequence[str] | None = None,
    ) -> PoolLayout:
        """The layout of blocks that span ``pools`` (all indexed on ``block_axis``): device
        arrays, DevicePools, or TorchPools (an engine's CPU KV tensors: one unsharded array
        each)."""
        if isinstance(pools, DevicePool | jax.Array | TorchPool):
            raise InvalidArgumentError(
                "pools: expected a list of device arrays or pools, got a single one; "
                "wrap it in a list"
            )
        for i, pool in enumerate(pools):
            if not isinstance(pool, DevicePool | jax.Array | TorchPool):
                raise InvalidArgumentError(
                    f"pools[{i}]: expected a jax.Array, DevicePool or TorchPool, got "
                    f"{type(pool).__name__}"
                )
        if names is not None and len(names) != len(pools):
            raise InvalidArgumentError(
                f"names: {len(names)} names for {len(pools)} pools; give one name per pool"
            )
        arrays = []
        for i, pool in enumerate(pools):
            if isinstance(pool, TorchPool):
                shape, dtype, n_shards = pool.shape, pool.dtype, 1
                full_blocks = shape[block_axis] if 0 <= block_axis < len(shape) else None
            else:
                side = resolve_device(pool, f"pools[{i}]")
                shape, dtype, n_shards = side.shard_shape, side.dtype, len(side.groups)
                full_blocks = side.array.shape[block_axis] if 0 <= block_axis < side.ndim else None
            if full_blocks is None:
                raise InvalidArgumentError(
                    f"block_axis: {block_axis} is out of range for pools[{i}] of rank {len(shape)}"
                )
            if shape[block_axis] != full_blocks:
                raise InvalidArgumentError(
                    f"pools[{i}]: sharded along the block axis ({block_axis}); shard KV pools "
                    "along other axes (e.g. heads) and keep every block whole"
                )
            arrays.append(
                ArrayLayout(
                    name=names[i] if names is not None else f"array{i}",
                    dtype=dtype.name,
                    shard_block_shape=shape[:block_axis] + shape[block_axis + 1 :],
                    block_axis=block_axis,
                    n_shards=n_shards,
                )
            )
        return cls(model_id, tuple(arrays))

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each array's part within a slot."""
        out, at = [], 0
        for array in self.arrays:
            out.append(at)
            at += array.block_bytes
        return tuple(out)

    @cached_property
    def payload_bytes(self) -> int:
        """Bytes of one block (the sum of every array's part)."""
        return sum(a.block_bytes for a in self.arrays)

    @cached_property
    def slot_bytes(self) -> int:
        """Bytes of one slot: the payload rounded up to a page."""
        return -(-self.payload_bytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT

    @cached_property
    def piece_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Offsets and lengths of a slot's contiguous pieces, in slot order."""
        offsets, lengths = [], []
        for array, base in zip(self.arrays, self.offsets, strict=True):
            offsets.append(base + np.arange(array.pieces, dtype=np.int64) * array.piece_bytes)
            lengths.append(np.full(array.pieces, array.piece_bytes, dtype=np.int64))
        return np.concatenate(offsets), np.concatenate(lengths)

    def describe(self) -> dict[str, Any]:
        return {
            "format": self.FORMAT_VERSION,
            "model_id": self.model_id,
            "arrays": [
                {
                    "name": a.name,
                    "dtype": a.dtype,
                    "shard_block_shape": list(a.shard_block_shape),
                    "block_axis": a.block_axis,
                    "n_shards": a.n_shards,
                }
                for a in self.arrays
            ],
        }

    @classmethod
    def from_description(cls, description: Any) -> PoolLayout:
        """The layout :meth:`describe` described. ``description`` may come from a damaged file
        or another process: anything but a well-formed description of a layout this build
        can hold raises :class:`~tpusync.errors.PoolFormatError` saying what is wrong."""
        return _layout_from_description(cls, description)

    @cached_property
    def fingerprint(self) -> bytes:
        """16 bytes naming this block format (BLAKE2b of the canonical description)."""
        text = json.dumps(self.describe(), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=16).digest()

    def host_view(self, buffer: Any, array_index: int, n_slots: int, offset: int = 0) -> Any:
        """Array ``array_index``'s part of ``n_slots`` slots starting ``offset`` bytes into
        ``buffer``, as the strided host array :func:`tpusync.transfer` expects for that array
        (``[shard][...]`` when the array has several shards; block axis = the slot axis)."""
        array = self.arrays[array_index]
        itemsize = array.np_dtype.itemsize
        inner = array.shard_block_shape[array.block_axis :]
        outer = array.outer_shape
        inner_strides = c_strides(inner, itemsize)
        outer_strides = c_strides(outer, array.piece_bytes)
        shape = (*outer, n_slots, *inner)
        strides = (*outer_strides, self.slot_bytes, *inner_strides)
        if array.n_shards > 1:
            shard_stride = math.prod(outer) * array.piece_bytes
            shape = (array.n_shards, *shape)
            strides = (shard_stride, *strides)
        return np.ndarray(
            shape,
            dtype=array.np_dtype,
            buffer=buffer,
            offset=offset + self.offsets[array_index],
            strides=strides,
        )


def _short(value: Any) -> str:
    """A bounded repr of a described value (which may be huge, or an int too long to print)."""
    try:
        text = repr(value)
    except ValueError:
        return f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _described_int(value: Any, what: str, low: int, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise PoolFormatError(
            f"layout description: {what} is {_short(value)}, not an int in [{low}, {high})"
        )
    return value


def _described_text(value: Any, what: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise PoolFormatError(
            f"layout description: {what} is {_short(value)}, not a string of at most {_MAX_TEXT}"
        )
    return value


def _described_dtype(value: Any, what: str) -> str:
    """A plain numpy dtype named as ``dtype.name`` names it (no objects, no structures)."""
    if not isinstance(value, str) or not _DTYPE_NAME.fullmatch(value):
        raise PoolFormatError(f"layout description: {what} is {_short(value)}, not a dtype name")
    try:
        dtype = np.dtype(value)
    except Exception:  # numpy raises TypeError or ValueError (or worse) for unknown names
        raise PoolFormatError(
            f"layout description: {what} {value!r} is not a known dtype"
        ) from None
    if dtype.name != value or dtype.hasobject or dtype.fields is not None or dtype.itemsize < 1:
        raise PoolFormatError(f"layout description: {what} {value!r} is not a plain dtype")
    return value


def _described_array(value: Any, where: str) -> ArrayLayout:
    expected = {"name", "dtype", "shard_block_shape", "block_axis", "n_shards"}
    if not isinstance(value, dict) or not expected <= value.keys():
        raise PoolFormatError(
            f"layout description: {where} is not an object with the fields {sorted(expected)}"
        )
    shape = value["shard_block_shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_DIMS:
        raise PoolFormatError(
            f"layout description: {where}.shard_block_shape is not a list of at most "
            f"{_MAX_DIMS} sizes"
        )
    dims = tuple(_described_int(n, f"{where}.shard_block_shape", 1, _MAX_DIM) for n in shape)
    array = ArrayLayout(
        name=_described_text(value["name"], f"{where}.name"),
        dtype=_described_dtype(value["dtype"], f"{where}.dtype"),
        shard_block_shape=dims,
        block_axis=_described_int(value["block_axis"], f"{where}.block_axis", 0, len(dims) + 1),
        n_shards=_described_int(value["n_shards"], f"{where}.n_shards", 1, _MAX_SHARDS),
    )
    if math.prod(dims) * array.n_shards * array.np_dtype.itemsize >= _MAX_BLOCK_BYTES:
        raise PoolFormatError(f"layout description: {where} describes blocks too large to hold")
    return array


def _layout_from_description(cls: type[PoolLayout], description: Any) -> PoolLayout:
    if not isinstance(description, dict):
        raise PoolFormatError(
            f"layout description: expected an object, got {type(description).__name__}"
        )
    version = description.get("format", PoolLayout.FORMAT_VERSION)
    if version != PoolLayout.FORMAT_VERSION or isinstance(version, bool):
        raise PoolFormatError(
            f"layout description: format {_short(version)}; this build reads "
            f"{PoolLayout.FORMAT_VERSION}"
        )
    if "model_id" not in description or "arrays" not in description:
        raise PoolFormatError("layout description: 'model_id' or 'arrays' is missing")
    model_id = _described_text(description["model_id"], "model_id")
    arrays = description["arrays"]
    if not isinstance(arrays, list) or not 1 <= len(arrays) <= _MAX_ARRAYS:
        raise PoolFormatError(
            f"layout description: 'arrays' is not a list of 1 to {_MAX_ARRAYS} arrays"
        )
    parsed = tuple(_described_array(a, f"arrays[{i}]") for i, a in enumerate(arrays))
    if sum(a.block_bytes for a in parsed) >= _MAX_BLOCK_BYTES:
        raise PoolFormatError("layout description: its blocks are too large to hold")
    try:
        return cls(model_id, parsed)
    except InvalidArgumentError as exc:  # e.g. two arrays of one name
        raise PoolFormatError(f"layout description: {exc}") from None
