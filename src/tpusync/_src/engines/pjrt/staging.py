"""Small device reads gathered on the device first, so the plugin gets few large copies.

Every ``PJRT_Buffer_CopyRawToHost`` is a call into the plugin with an event and a callback
(microseconds each), while a KV block of one layer is often tens of KiB: issued one by one, the
calls and not the link would set the pace. So before the copy, the rows that read small pieces
of device buffers are gathered on the device by one jitted call per device into a fresh staging
array, laid out in the order of their host destinations (rows of several buffers interleaved:
the pieces of one HostPool slot come from every layer's array). Rows whose destinations follow
each other then read consecutive staging bytes and merge into one copy: a run of consecutive
slots is one call instead of one per piece.

The gather moves bits (every buffer is bitcast to uint8 rows of one unit: the largest size
every staged row length and source offset of the device is a multiple of, at least 64 bytes),
so NaN payloads survive; rows of dtypes that cannot be bitcast, or without such a unit, are
copied as they are. Row counts are padded to powers of two so that a handful of compiled
gathers serve every request size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tpusync import options

# Rows smaller than this (bytes) are gathered on the device first; 0 turns staging off.
DEFAULT_STAGE_BELOW = options.DEFAULT_STAGE_BELOW
# Limits of a gather's index arrays (they travel to the device): units of at least this many
# bytes, at most this many units per device and call; else the rows are copied as they are.
MIN_UNIT = 64
MAX_UNITS = 1 << 22
# Staging memory on the device per gather: larger reads are gathered in chunks of this size.
CHUNK_BYTES = 256 << 20


def stage_below() -> int:
    """Rows below this many bytes are staged (``Options.pjrt_stage_below``, default 1 MiB)."""
    return options.current().pjrt_stage_below


def locate(
    addresses: np.ndarray, starts: np.ndarray, ends: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Which addresses lie in one of the sorted, disjoint ranges [starts[i], ends[i]), and the
    index of the last range starting at or before each (meaningful where inside)."""
    at = np.searchsorted(starts, addresses, side="right").astype(np.int64) - 1
    inside = at >= 0
    inside[inside] = addresses[inside] < ends[at[inside]]
    return inside, at


def _bucket(n: int) -> int:
    return max(8, 1 << (n - 1).bit_length())


@cache
def _gather(n_inputs: int, row_bytes: int) -> Callable[..., jax.Array]:
    """A jitted gather: rows of ``row_bytes`` from each input (as uint8), concatenated, then
    put in destination order."""

    def rows_of(array: jax.Array) -> jax.Array:
        if array.dtype != jnp.uint8:
            array = jax.lax.bitcast_convert_type(array, jnp.uint8)
        return array.reshape(-1, row_bytes)

    def gather(arrays: tuple[jax.Array, ...], indices: tuple[jax.Array, ...], order: jax.Array):
        parts = [
            jnp.take(rows_of(a), i, axis=0, mode="clip")
            for a, i in zip(arrays, indices, strict=True)
        ]
        every = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        return jnp.take(every, order, axis=0, mode="clip")

    return jax.jit(gather)


def _bitcasts(array: Any) -> bool:
    """Whether the array's dtype bitcasts to uint8 in JAX."""
    dtype = np.dtype(array.dtype)
    return dtype != np.bool_ and dtype.kind != "c" and dtype.itemsize in (1, 2, 4, 8)


def stage_reads(
    table: np.ndarray, buffers: list[Any], below: int
) -> tuple[np.ndarray, list[tuple[Any, jax.Array]]]:
    """Returns the table with its small device reads redirected to staging arrays (merged where
    source and destination both continue), and the (device, staging array) pairs made; the
    caller views and reads them like any device buffer and keeps them alive until the copy is
    done. ``buffers`` are the table's device buffers (``engines.pjrt.engine.DeviceBuffer``)."""
    if below <= 0 or not len(table):
        return table, []
    readable = [b for b in buffers if b.array is not None and not b.written]
    if not readable:
        return table, []
    starts = np.array([b.address for b in readable], dtype=np.uint64)
    order = np.argsort(starts, kind="stable")
    starts = starts[order]
    ends = starts + np.array([readable[i].nbytes for i in order], dtype=np.uint64)
    inside, at = locate(table[:, 0], starts, ends)
    small = inside & (table[:, 2] < below)
    if not small.any():
        return table, []
    owner = np.full(len(table), -1, dtype=np.int64)
    owner[inside] = order[at[inside]]
    keep = np.ones(len(table), dtype=bool)
    new_rows: list[np.ndarray] = []
    staged: list[tuple[Any, jax.Array]] = []
    by_device: dict[Any, list[int]] = {}
    for index in np.unique(owner[small]):
        if _bitcasts(readable[index].array):  # others' rows are copied as they are
            by_device.setdefault(readable[index].device, []).append(int(index))
    addresses = np.array([b.address for b in readable], dtype=np.uint64)
    for device, members in by_device.items():
        rows = np.flatnonzero(small & np.isin(owner, members))
        rows = rows[np.argsort(table[rows, 1], kind="stable")]  # destination order
        offsets = table[rows, 0] - addresses[owner[rows]]
        # the unit: the largest size every staged row and offset is a multiple of (a row merged
        # from neighbouring pieces is several units)
        unit = int(np.gcd.reduce(np.concatenate([table[rows, 2], offsets]).astype(np.int64)))
        counts = (table[rows, 2] // np.uint64(max(unit, 1))).astype(np.int64)
        if (
            unit < MIN_UNIT
            or int(counts.sum()) > MAX_UNITS
            or any(int(readable[i].array.nbytes) % unit for i in members)
        ):
            continue  # copied as they are
        # bounded staging memory: a gather per chunk of at most CHUNK_BYTES
        sizes = table[rows, 2].astype(np.int64)
        chunk_of = (np.cumsum(sizes) - sizes) // CHUNK_BYTES
        for chunk in np.unique(chunk_of):
            part = chunk_of == chunk
            staging, redirected = _stage(
                table[rows[part]], offsets[part], counts[part], owner[rows[part]],
                [(i, readable[i].array) for i in members], unit, device,
            )  # fmt: skip
            new_rows.append(_merge(redirected))
            staged.append((device, staging))
        keep[rows] = False
    if not staged:
        return table, []
    return np.concatenate([table[keep], *new_rows]), staged


def _stage(
    rows: np.ndarray,
    offsets: np.ndarray,
    counts: np.ndarray,
    owners: np.ndarray,
    members: list[tuple[int, jax.Array]],
    unit: int,
    device: Any,
) -> tuple[jax.Array, np.ndarray]:
    """Gathers the units of ``rows`` (in destination order) into a staging array on
    ``device``; returns it and the rows redirected to read it."""
    within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    unit_index = np.repeat((offsets // np.uint64(unit)).astype(np.int64), counts) + within
    unit_owner = np.repeat(owners, counts)
    arrays, indices, position = [], [], np.empty(len(unit_index), dtype=np.int64)
    base = 0
    for i, array in members:
        mine = np.flatnonzero(unit_owner == i)
        if not len(mine):
            continue
        padded = np.zeros(_bucket(len(mine)), dtype=np.int32)
        padded[: len(mine)] = unit_index[mine]
        position[mine] = base + np.arange(len(mine))
        arrays.append(array)
        indices.append(padded)
        base += len(padded)
    final = np.zeros(_bucket(len(unit_index)), dtype=np.int32)
    final[: len(unit_index)] = position
    staging = _gather(len(arrays), unit)(
        tuple(arrays),
        tuple(jax.device_put(i, device) for i in indices),
        jax.device_put(final, device),
    )
    staging.block_until_ready()  # a view has no definition event
    # each row now reads its units from the staging array, where they follow each other
    redirected = rows.copy()
    unit_start = (np.cumsum(counts) - counts).astype(np.uint64)
    redirected[:, 0] = np.uint64(staging.unsafe_buffer_pointer()) + unit_start * np.uint64(unit)
    return staging, redirected


def _merge(rows: np.ndarray) -> np.ndarray:
    """Rows sorted by destination, each continuing the previous one on both sides, as one."""
    src, dst, size = rows[:, 0], rows[:, 1], rows[:, 2]
    starts = np.ones(len(rows), dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + size[:-1]) | (dst[1:] != dst[:-1] + size[:-1])
    first = np.flatnonzero(starts)
    totals = np.add.reduceat(size, first)
    return np.stack([src[first], dst[first], totals], axis=1).astype(np.uint64)
