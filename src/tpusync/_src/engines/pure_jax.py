"""The pure-JAX engine: runs wherever JAX runs, and is the reference the native path must equal.

Data moves as bits: floating-point arrays are bitcast to the unsigned integer of the same width
before any jitted gather or scatter, because those canonicalize NaN payloads of bfloat16 and
float8 values. Gathers are jitted ``take`` on the block axis, written to host memory through
``copy_to_host_async``; writes into a pool are one donated jitted scatter whose result the pool
swaps in. Index lists are padded to a few bucket sizes so that varying lengths reuse compiled code.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tpusync._src.engines.base import DeviceSide, HostSide, Move
from tpusync._src.memory.device_pool import replace_array

__all__ = ["ENGINE", "JaxEngine", "bits_dtype", "bucket", "run"]

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits_dtype(dtype: np.dtype) -> np.dtype | None:
    """The unsigned dtype to move ``dtype``'s bits through, or None to move it as it is.

    Floating-point types of 8 bits or more (including ml_dtypes' bfloat16 and float8 types, which
    numpy does not count as ``np.floating``) go through their unsigned twin; integers, bools,
    complex values and sub-byte types pass gathers unchanged.
    """
    if dtype.kind in "biuc":
        return None
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            if info(dtype).bits < 8:
                return None
            break
        except (TypeError, ValueError):
            continue
    unsigned = _UNSIGNED.get(dtype.itemsize)
    return np.dtype(unsigned) if unsigned is not None else None


def _to_bits(x: jax.Array) -> jax.Array:
    unsigned = bits_dtype(np.dtype(x.dtype))
    return x if unsigned is None else jax.lax.bitcast_convert_type(x, unsigned)


def _from_bits(bits: jax.Array, dtype: np.dtype) -> jax.Array:
    return bits if bits.dtype == dtype else jax.lax.bitcast_convert_type(bits, dtype)


def _host_bits(view: np.ndarray) -> np.ndarray:
    unsigned = bits_dtype(view.dtype)
    return view if unsigned is None else view.view(unsigned)


def bucket(n: int) -> int:
    """Pads index lists to 8, 12, 16, 24, 32, 48, ... entries (at most a third wasted)."""
    if n <= 8:
        return 8
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if n <= power * 3 // 4 else power


def _padded(indices: np.ndarray) -> np.ndarray:
    size = bucket(len(indices))
    if size == len(indices):
        return indices
    return np.concatenate([indices, np.full(size - len(indices), indices[-1], np.int64)])


def _index_at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


@cache
def _gather_fn(axis: int, out_sharding: Any) -> Any:
    def gather(x: jax.Array, idx: jax.Array) -> jax.Array:
        return jnp.take(_to_bits(x), idx, axis=axis, mode="clip")

    return jax.jit(gather, out_shardings=out_sharding)


@cache
def _bits_fn(out_sharding: Any) -> Any:
    return jax.jit(_to_bits, out_shardings=out_sharding)


@cache
def _move_within_fn(axis: int) -> Any:
    def move(pool: jax.Array, src_idx: jax.Array, dst_idx: jax.Array) -> jax.Array:
        bits = _to_bits(pool)
        blocks = jnp.take(bits, src_idx, axis=axis, mode="clip")
        bits = bits.at[_index_at(axis, dst_idx)].set(blocks, mode="promise_in_bounds")
        return _from_bits(bits, np.dtype(pool.dtype))

    return jax.jit(move, donate_argnums=0)


@cache
def _copy_between_fn(axis: int) -> Any:
    def copy(pool: jax.Array, src: jax.Array, src_idx: jax.Array, dst_idx: jax.Array) -> Any:
        blocks = jnp.take(_to_bits(src), src_idx, axis=axis, mode="clip")
        bits = _to_bits(pool).at[_index_at(axis, dst_idx)].set(blocks, mode="promise_in_bounds")
        return _from_bits(bits, np.dtype(pool.dtype))

    return jax.jit(copy, donate_argnums=0)


@cache
def _overwrite_fn() -> Any:
    def overwrite(pool: jax.Array, src: jax.Array) -> jax.Array:
        bits = jax.lax.dynamic_update_slice(_to_bits(pool), _to_bits(src), (0,) * pool.ndim)
        return _from_bits(bits, np.dtype(pool.dtype))

    return jax.jit(overwrite, donate_argnums=0)


def _pinned_host(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    try:
        return sharding.with_memory_kind("pinned_host")
    except (ValueError, NotImplementedError):  # pragma: no cover - backends without it
        return sharding


# --- device -> host -----------------------------------------------------------------------------


def _device_to_host(move: Move) -> None:
    src, dst = move.src, move.dst
    assert isinstance(src, DeviceSide) and isinstance(dst, HostSide)
    array = src.array
    n = len(move.src_blocks)
    out_sharding = _pinned_host(array.sharding)
    if move.whole:
        gathered = _bits_fn(out_sharding)(array)
    else:
        idx = jnp.asarray(_padded(move.src_blocks))
        gathered = _gather_fn(move.block_axis, out_sharding)(array, idx)
    shards = {shard.device: shard.data for shard in gathered.addressable_shards}
    chosen = [shards[group.devices[0]] for group in src.groups]
    for data in chosen:
        data.copy_to_host_async()
    for data, view in zip(chosen, dst.views, strict=True):
        blocks = np.asarray(data)
        if not move.whole:
            blocks = blocks[_index_at(move.block_axis, slice(0, n))]
        target = _host_bits(view)
        if move.whole:
            np.copyto(target, blocks)
        else:
            target[_index_at(move.block_axis, move.dst_blocks)] = blocks


# --- host -> device -----------------------------------------------------------------------------


def _host_to_pool(move: Move) -> None:
    src, dst = move.src, move.dst
    assert isinstance(src, HostSide) and isinstance(dst, DeviceSide) and dst.pool is not None
    pool_array = dst.array
    per_device = []
    # device_put of an aligned host array aliases it on CPU (no copy); the fused gather-scatter
    # then makes the one copy into the donated pool. The source must stay unchanged until the
    # future completes, which transfer()'s contract already asks of every source.
    for group, view in zip(dst.groups, src.views, strict=True):
        for device in group.devices:
            per_device.append(jax.device_put(view, device))
    host_shape = list(pool_array.shape)
    host_shape[move.block_axis] = src.views[0].shape[move.block_axis]
    host_array = jax.make_array_from_single_device_arrays(
        tuple(host_shape), pool_array.sharding, per_device
    )
    if move.whole:
        # Never swap in host_array itself: on CPU it may share the caller's memory (jax 0.10
        # aliases aligned numpy arrays even with may_alias=False). Copy into the pool instead.
        result = _overwrite_fn()(pool_array, host_array)
    else:
        src_idx = jnp.asarray(_padded(move.src_blocks))
        dst_idx = jnp.asarray(_padded(move.dst_blocks))
        result = _copy_between_fn(move.block_axis)(pool_array, host_array, src_idx, dst_idx)
    replace_array(dst.pool, result)


# --- device -> device, host -> host -------------------------------------------------------------


def _device_to_pool(move: Move) -> None:
    src, dst = move.src, move.dst
    assert isinstance(src, DeviceSide) and isinstance(dst, DeviceSide) and dst.pool is not None
    src_idx = jnp.asarray(_padded(move.src_blocks))
    dst_idx = jnp.asarray(_padded(move.dst_blocks))
    pool_array = dst.array
    source = src.array
    if source is pool_array:
        result = _move_within_fn(move.block_axis)(pool_array, src_idx, dst_idx)
    else:
        result = _copy_between_fn(move.block_axis)(pool_array, source, src_idx, dst_idx)
    replace_array(dst.pool, result)


def _host_to_host(move: Move) -> None:
    src, dst = move.src, move.dst
    assert isinstance(src, HostSide) and isinstance(dst, HostSide)
    for source, target in zip(src.views, dst.views, strict=True):
        blocks = np.take(_host_bits(source), move.src_blocks, axis=move.block_axis)
        _host_bits(target)[_index_at(move.block_axis, move.dst_blocks)] = blocks


def run(moves: list[Move]) -> int:
    """Moves every pair through JAX; pools' locks must be held by the caller."""
    total = 0
    for move in moves:
        if not len(move.src_blocks) or math.prod(move.src.shard_shape) == 0:
            continue
        if isinstance(move.src, DeviceSide):
            if isinstance(move.dst, DeviceSide):
                _device_to_pool(move)
            else:
                _device_to_host(move)
        elif isinstance(move.dst, DeviceSide):
            _host_to_pool(move)
        else:
            _host_to_host(move)
        total += move.nbytes
    for move in moves:
        if isinstance(move.dst, DeviceSide):
            move.dst.array.block_until_ready()
    return total


class JaxEngine:
    """The pure-JAX engine as an :class:`~tpusync._src.engines.base.Engine`: serves every side."""

    name = "jax"

    def unavailable(self, move: Move, *, explicit: bool) -> list[str]:
        return []

    def run(self, moves: list[Move]) -> int:
        return run(moves)  # looked up at call time: tests may count the module's run


ENGINE = JaxEngine()
