"""Resolves transfer endpoints into shards and strided host views, validating as it goes.

A transfer side is either a *device* side (a ``jax.Array`` or :class:`DevicePool`) or a *host*
side (a numpy array, :class:`HostBuffer`, a CPU ``torch.Tensor`` or, as a destination, a
``TorchPool``: a numpy view of the tensor's own memory). A device array is cut into its
distinct addressable shards; the matching host side holds them as ``[shard][...]``: a leading
shard axis in the documented shard order (by the shards' start indices, row-major). A host
side for an array with one distinct shard (single-device or replicated) may leave that axis
out.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np

from tpusync._src.engines.base import DeviceSide, HostSide, IndexKey, ShardGroup, Side
from tpusync._src.memory import fork_guard
from tpusync._src.memory.device_pool import DevicePool, check_alive, current_array, lock_of
from tpusync._src.memory.host_buffer import HostBuffer
from tpusync._src.memory.torch_tensors import TorchPool, host_view, is_tensor
from tpusync.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    NotAPoolError,
    ReadOnlyDestinationError,
    ShapeMismatchError,
    WrongDeviceError,
)

__all__ = [
    "TRACED",
    "as_host_array",
    "check_pair",
    "host_views_for",
    "resolve",
    "resolve_device",
]

# A traced value has no buffer to move: what a side or block list inside jax.jit is told.
TRACED = (
    "transfer() cannot be called inside jax.jit (or other JAX transformations); call it outside "
    "the jitted function"
)


def _index_key(index: tuple[slice, ...], shape: tuple[int, ...]) -> IndexKey:
    return tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))


@functools.lru_cache(maxsize=256)
def _shard_groups(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[tuple[ShardGroup, ...], tuple[int, ...]]:
    """The distinct addressable shards of arrays of ``shape`` under ``sharding``, in the
    documented order, and the shard shape (cached: pools keep their sharding)."""
    index_map = sharding.addressable_devices_indices_map(shape)
    groups: dict[IndexKey, list[Any]] = {}
    for device, index in index_map.items():
        groups.setdefault(_index_key(index, shape), []).append(device)
    ordered = tuple(
        ShardGroup(key, tuple(sorted(groups[key], key=lambda d: d.id)))
        for key in sorted(groups, key=lambda k: tuple(start for start, _ in k))
    )
    return ordered, tuple(int(n) for n in sharding.shard_shape(shape))


def resolve_device(obj: jax.Array | DevicePool, argument: str) -> DeviceSide:
    """Cuts a device side into shard groups from its sharding alone (no buffer is touched).

    A pool's shape, dtype and sharding are fixed for its lifetime, so its array is read without
    waiting for the pool's lock: validating never waits for a transfer that runs on the pool.
    Whether a busy pool's array is still alive is checked when the transfer runs.
    """
    fork_guard.check_device_use(argument)  # before the pool's lock and any JAX call
    pool = obj if isinstance(obj, DevicePool) else None
    array = current_array(pool) if pool is not None else obj
    assert isinstance(array, jax.Array)
    if pool is None:
        check_alive(array, argument)
    elif lock_of(pool).acquire(blocking=False):  # idle pool: check now; busy: when it runs
        try:
            check_alive(current_array(pool), argument)
        finally:
            lock_of(pool).release()
    shape = tuple(int(n) for n in array.shape)
    try:
        ordered, shard_shape = _shard_groups(array.sharding, shape)
    except TypeError:  # an unhashable sharding: no caching
        ordered, shard_shape = _shard_groups.__wrapped__(array.sharding, shape)
    if not ordered:
        raise WrongDeviceError(
            f"{argument}: no shard of this array is addressable from process "
            f"{jax.process_index()}; transfer it in a process that owns some of its devices"
        )
    return DeviceSide(argument, None if pool is not None else array, pool, shard_shape, ordered)


def as_host_array(obj: Any, argument: str) -> np.ndarray | None:
    if isinstance(obj, HostBuffer):
        if obj.closed:
            raise InvalidArgumentError(f"{argument}: this HostBuffer is closed; pass an open one")
        host = obj.array
    elif isinstance(obj, np.ndarray):
        host = obj
    else:
        return None
    if host.dtype.hasobject:
        raise InvalidArgumentError(
            f"{argument}: dtype {host.dtype} holds Python objects, which cannot be moved as "
            "bytes; use a numeric dtype"
        )
    return host


def resolve(obj: Any, argument: str, *, destination: bool) -> Side:
    """Classifies one side; host sides are normalized later against their partner."""
    if isinstance(obj, DevicePool):
        return resolve_device(obj, argument)
    if isinstance(obj, jax.core.Tracer):
        raise InvalidArgumentError(f"{argument}: {TRACED}")
    if isinstance(obj, jax.Array):
        if destination:
            raise NotAPoolError(
                f"{argument}: tpusync writes device memory only through a DevicePool; wrap the "
                f"array once with tpusync.DevicePool({argument}) and pass the pool"
            )
        return resolve_device(obj, argument)
    if isinstance(obj, TorchPool):
        return HostSide(argument, [obj.host_view(argument)], pool=obj)
    if is_tensor(obj):
        if destination:
            raise NotAPoolError(
                f"{argument}: tpusync writes a torch tensor only through a TorchPool; wrap it "
                f"once with tpusync.TorchPool({argument}) and pass the pool"
            )
        return HostSide(argument, [host_view(obj, argument)])
    host = as_host_array(obj, argument)
    if host is None:
        raise InvalidArgumentError(
            f"{argument}: expected a jax.Array, tpusync.DevicePool, tpusync.HostBuffer, "
            f"numpy.ndarray, torch.Tensor or tpusync.TorchPool, got {type(obj).__name__}"
        )
    if destination and not host.flags.writeable:
        raise ReadOnlyDestinationError(
            f"{argument}: this numpy array is read-only (e.g. np.asarray of a jax.Array); "
            "pass a writable array such as a tpusync.HostBuffer"
        )
    return HostSide(argument, [host])


def host_views_for(host: HostSide, device: DeviceSide, block_axis: int) -> None:
    """Splits a host array into one view per shard group of ``device`` (in place)."""
    (array,) = host.views
    n_groups = len(device.groups)
    if array.ndim == device.ndim + 1:
        if array.shape[0] != n_groups:
            raise ShapeMismatchError(
                f"{host.argument}: its leading axis has {array.shape[0]} entries but "
                f"{device.argument} has {n_groups} distinct addressable shards; the host side "
                "of a sharded array is laid out [shard][blocks...]"
            )
        host.views = [array[i] for i in range(n_groups)]
    elif array.ndim == device.ndim and n_groups == 1:
        host.views = [array]
    else:
        want = f"(n_shards={n_groups}, *{device.shard_shape})"
        if n_groups == 1:
            want += f" or {device.shard_shape}"
        raise ShapeMismatchError(
            f"{host.argument}: shape {array.shape} does not fit {device.argument}'s shards "
            f"{device.shard_shape}; expected {want} with any number of blocks on "
            f"axis {block_axis}"
        )


def check_pair(src: Side, dst: Side, block_axis: int) -> None:
    """Checks dtype, rank, block shape and devices of a (source, destination) pair."""
    shapes = (_given_shape(src), _given_shape(dst))  # before host views are cut into shards
    if isinstance(src, HostSide) and isinstance(dst, DeviceSide):
        host_views_for(src, dst, block_axis)
    elif isinstance(dst, HostSide) and isinstance(src, DeviceSide):
        host_views_for(dst, src, block_axis)
    if src.dtype != dst.dtype:
        raise _dtype_error(src, dst, *shapes)
    src_shape, dst_shape = src.shard_shape, dst.shard_shape
    ndim = len(src_shape)
    if not 0 <= block_axis < ndim:
        raise InvalidArgumentError(
            f"block_axis: {block_axis} is out of range for blocks of rank {ndim}; use 0..{ndim - 1}"
        )
    if len(dst_shape) != ndim or _drop(src_shape, block_axis) != _drop(dst_shape, block_axis):
        # a pool's shape is fixed: where a host side meets a device side, the host side is off
        odd, fixed = (
            (src, dst) if isinstance(src, HostSide) and isinstance(dst, DeviceSide) else (dst, src)
        )
        raise ShapeMismatchError(
            f"{odd.argument}: shape {odd.shard_shape} does not match {fixed.argument}'s "
            f"{fixed.shard_shape} outside the block axis ({block_axis}); blocks must have the "
            "same shape"
        )
    for side in (src, dst):
        if (
            isinstance(side, DeviceSide)
            and side.shard_shape[block_axis] != side.array.shape[block_axis]
        ):
            raise ShapeMismatchError(
                f"{side.argument}: the array is sharded along the block axis ({block_axis}); "
                "shard KV pools along other axes (e.g. heads) and keep every block whole"
            )
    if isinstance(src, DeviceSide) and isinstance(dst, DeviceSide):
        src_devices = [g.devices for g in src.groups]
        dst_devices = [g.devices for g in dst.groups]
        if src_devices != dst_devices:
            raise WrongDeviceError(
                f"{dst.argument}: its shards live on {_fmt_devices(dst_devices)} but "
                f"{src.argument}'s on {_fmt_devices(src_devices)}; device-to-device copies "
                "need the same devices and sharding on both sides"
            )
    for side in (src, dst):
        if isinstance(side, HostSide):
            for view in side.views:
                _check_blocks_contiguous(view, block_axis, side.argument)


def _drop(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    return shape[:axis] + shape[axis + 1 :]


def _fmt_devices(groups: list[tuple[Any, ...]]) -> str:
    return "[" + ", ".join("/".join(str(d.id) for d in g) for g in groups) + "]"


def _given_shape(side: Side) -> tuple[int, ...]:
    """The shape of the array the caller passed (a device array's global shape)."""
    if isinstance(side, DeviceSide):
        return tuple(int(n) for n in side.array.shape)
    return tuple(side.views[0].shape)


def _dtype_error(
    src: Side, dst: Side, src_shape: tuple[int, ...], dst_shape: tuple[int, ...]
) -> Exception:
    hint = "; both sides need the same dtype (tpusync moves bytes, it never converts)"
    if src.dtype.itemsize == dst.dtype.itemsize:
        hint = f"; to move raw bits, pass a .view({src.dtype}) of the host array"
    return DtypeMismatchError(
        f"{dst.argument}: dtype {dst.dtype} (shape {dst_shape}) differs from {src.argument}'s "
        f"dtype {src.dtype} (shape {src_shape}){hint}"
    )


def _check_blocks_contiguous(view: np.ndarray, block_axis: int, argument: str) -> None:
    if view.size == 0:
        return  # numpy gives empty arrays zero strides; there is nothing to copy
    expected = view.dtype.itemsize
    for axis in range(view.ndim - 1, block_axis, -1):
        if view.shape[axis] > 1 and view.strides[axis] != expected:
            raise ShapeMismatchError(
                f"{argument}: each block must be contiguous in memory (axes after the block "
                f"axis C-ordered), but axis {axis} has stride {view.strides[axis]} instead of "
                f"{expected}; pass np.ascontiguousarray(...) or a view with contiguous blocks"
            )
        expected *= view.shape[axis]
