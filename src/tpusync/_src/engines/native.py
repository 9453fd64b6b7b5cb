"""The native engine: gather/scatter of block segments over the shards' buffers.

On the CPU backend a segment table is raw memory copied in C (the copy engine); on PJRT plugin
backends the same table runs through the plugin's C API (:mod:`tpusync._src.engines.pjrt.engine`):
planning is the same, only the last step differs.

Runs under the device-memory safety rules of :mod:`tpusync._src.memory.device_pool`: destinations
are pools whose readers were waited for, and every device buffer read or written is pinned by a
live DLPack capsule for the whole copy, so JAX can neither free nor reuse it (a donation while
the capsule lives falls back to a copy).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np

from tpusync import options
from tpusync._native import core as _core
from tpusync._src.engines.base import DeviceSide, HostSide, Move
from tpusync._src.engines.devices import device_path
from tpusync._src.engines.pjrt import engine as pjrt
from tpusync._src.engines.segments import Region, block_bytes, segments, strided_offsets
from tpusync._src.memory.device_pool import (
    DevicePool,
    current_array,
    device_layout,
    engine_notes,
    wait_for_readers,
)

__all__ = [
    "ENGINE",
    "BlockPlan",
    "NativeEngine",
    "copy_threads",
    "engine",
    "overlaps",
    "pjrt_device",
    "pjrt_device_of",
    "plan_segments",
    "pool_unavailable_reason",
    "run",
    "run_hashed",
    "run_hashed_plan",
    "unavailable_reason",
]

_engine: _core.CopyEngine | None = None
_engine_lock = threading.Lock()


def copy_threads() -> int:
    """Threads the copy engine uses: ``Options.copy_threads`` (``TPUSYNC_COPY_THREADS``), else
    one per usable core (at most 8)."""
    configured = options.current().copy_threads
    if configured is not None:
        return configured
    return max(1, min(8, len(os.sched_getaffinity(0))))


def engine() -> _core.CopyEngine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _core.CopyEngine(copy_threads())
        return _engine


def _forget_engine_after_fork() -> None:
    # A forked child inherits the engine but not its threads: a copy would wait forever for
    # workers that do not exist. Start a fresh engine (and lock) on first use instead.
    global _engine, _engine_lock
    _engine = None
    _engine_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_engine_after_fork)


def _pin_buffer(data: jax.Array) -> Any:
    """Returns a live DLPack capsule of a single-device array: while it lives, JAX neither frees
    nor reuses the buffer (a donation falls back to a copy). Its creation also waits until the
    buffer's contents are ready."""
    if _to_capsule is not None:
        try:
            # what __dlpack__ ends in, without its checks and per-call shard array: a load
            # pins every array of the layout (docs/decisions/0004)
            return _to_capsule(data, stream=None)
        except Exception:  # another jax: the public way
            pass
    return data.__dlpack__()


try:
    from jax._src.lib import _jax as _jax_lib

    _to_capsule = _jax_lib.buffer_to_dlpack_managed_tensor
except (ImportError, AttributeError):  # pragma: no cover - jax without it
    _to_capsule = None


class Holds(list):
    """What keeps one copy's device buffers alive (pins), and, on PJRT devices, the buffers its
    segment table addresses (the views the plugin copies through)."""

    def __init__(self) -> None:
        super().__init__()
        self.device_buffers: list[pjrt.DeviceBuffer] = []


def _pinned_address(pin: Any, data: jax.Array) -> int:
    """The address of ``data``'s buffer, read from its pin where that is a DLPack capsule:
    jaxlib's ``unsafe_buffer_pointer`` on an array made by ``device_put`` can fail while another
    thread reads the same array ("supported only for unsharded arrays"); the capsule cannot."""
    address = _core.dlpack_address(pin)
    return data.unsafe_buffer_pointer() if address is None else address


def _hold(holds: list[Any], data: jax.Array, device: Any, written: bool) -> int:
    """Pins a single-device buffer for the copy and returns its address; a PJRT device's buffer
    is also waited for (a view has no definition event) and recorded in ``holds``."""
    if (device.platform == "cpu" and not pjrt.any_bound()) or device_path(device).engine != "pjrt":
        pin = _pin_buffer(data)
        holds.append(pin)
        return _pinned_address(pin, data)
    try:
        pin = _pin_buffer(data)
    except Exception:  # no DLPack export here: the reference alone keeps the buffer alive
        pin = data
    holds.append(pin)
    data.block_until_ready()
    address = _pinned_address(pin, data)
    if isinstance(holds, Holds):
        holds.device_buffers.append(
            pjrt.DeviceBuffer(device, address, int(data.nbytes), written, data)
        )
    return address


def _device_regions(side: DeviceSide, holds: list[Any], written: bool) -> list[list[Region]]:
    """Per shard group, the region of each replica (in the group's device order)."""
    array = side.array
    if len(side.groups) == 1 and len(array.sharding.device_set) == 1:
        by_device = {side.groups[0].devices[0]: array}  # one shard: the array is its data
    else:
        by_device = {shard.device: shard.data for shard in array.addressable_shards}
    itemsize = side.dtype.itemsize
    out = []
    for group in side.groups:
        regions = []
        for device in group.devices:
            address = _hold(holds, by_device[device], device, written)  # until the copy is done
            regions.append(Region.contiguous(address, side.shard_shape, itemsize))
        out.append(regions)
    return out


def _regions(
    side: DeviceSide | HostSide, holds: list[Any], written: bool = False
) -> list[list[Region]]:
    if isinstance(side, DeviceSide):
        return _device_regions(side, holds, written)
    return [[Region.of_array(view)] for view in side.views]


def _copy(table: np.ndarray, holds: list[Any]) -> int:
    """Runs a segment table: through the plugin where it addresses PJRT device buffers."""
    if isinstance(holds, Holds) and holds.device_buffers:
        return pjrt.copy(table, holds.device_buffers)
    return int(engine().copy(table)) if len(table) else 0


def _copy_hashed(table: np.ndarray, holds: list[Any]) -> np.ndarray:
    """Runs a segment table and returns each row's piece checksum over its host bytes (on PJRT
    devices hashed after the copy: the host end of every row, which the copy left as is)."""
    if isinstance(holds, Holds) and holds.device_buffers:
        pjrt.copy(table, holds.device_buffers)
        return engine().hash(pjrt.host_ends(table, holds.device_buffers))
    return engine().copy_hashed(table)


_U64 = 1 << 64


def plan_segments(
    move: Move, holds: list[Any], merge: bool = True, memo: dict[Any, Any] | None = None
) -> list[np.ndarray]:
    """Segments for one move, one table per (shard group, destination replica) in that order;
    destination pools must already be prepared for raw writes.

    ``memo`` (one dict per batch) lets moves of the same geometry and the same block lists --
    a KV slot's per-layer arrays -- reuse the first one's table, shifted by their base
    addresses, instead of planning again."""
    dst_regions = _regions(move.dst, holds, written=True)
    src_regions = _regions(move.src, holds)
    itemsize = move.src.dtype.itemsize
    pairs = [
        (src_group[0], target)  # a replicated shard is read once and written to every replica
        for src_group, dst_group in zip(src_regions, dst_regions, strict=True)
        for target in dst_group
    ]
    key = None
    if memo is not None:
        # ids are stable here: the memo lives for one batch, whose moves hold these arrays
        key = (
            id(move.src_blocks),
            id(move.dst_blocks),
            move.block_axis,
            itemsize,
            merge,
            tuple((s.shape, s.strides, d.shape, d.strides) for s, d in pairs),
        )
        seen = memo.get(key)
        if seen is not None:
            bases, tables = seen
            return [
                table
                + np.array(
                    [(s.base - s0) % _U64, (d.base - d0) % _U64, 0], dtype=np.uint64
                )  # wraps modulo 2**64 like the addresses
                for (s, d), (s0, d0), table in zip(pairs, bases, tables, strict=True)
            ]
    parts = [
        segments(s, d, move.src_blocks, move.dst_blocks, move.block_axis, itemsize, merge=merge)
        for s, d in pairs
    ]
    if memo is not None:
        memo[key] = ([(s.base, d.base) for s, d in pairs], parts)
    return parts


def _prepare_destinations(moves: list[Move]) -> None:
    """Waits for every reader of every destination pool (see memory.device_pool), all at
    once."""
    pools = {}
    for move in moves:
        if isinstance(move.dst, DeviceSide) and move.dst.pool is not None:
            pools[id(move.dst.pool)] = move.dst.pool
    if pools:
        wait_for_readers(list(pools.values()))


def run_hashed(moves: list[Move]) -> list[np.ndarray]:
    """Like :func:`run`, and returns for each move the checksum (``_core.sum64``) of every piece
    it copied, computed
    in the same pass: an array of shape (shard groups, outer pieces, blocks), from the first
    replica of each group. Sources and destinations must not overlap."""
    _prepare_destinations(moves)
    holds = Holds()
    try:
        tables, shapes = [], []
        memo: dict[Any, Any] = {}
        for move in moves:
            parts = plan_segments(move, holds, merge=False, memo=memo)
            outer = math.prod(move.src.shard_shape[: move.block_axis])
            groups = len(move.groups())
            shapes.append((groups, len(parts) // groups, outer, len(move.src_blocks)))
            tables.append(np.concatenate(parts) if parts else np.empty((0, 3), np.uint64))
        whole = np.concatenate(tables) if tables else np.empty((0, 3), np.uint64)
        if overlaps(whole):
            raise ValueError("hashed copies need sources and destinations that do not overlap")
        digests = _copy_hashed(whole, holds)
    finally:
        del holds
    out, at = [], 0
    for (groups, replicas, outer, blocks), table in zip(shapes, tables, strict=True):
        part = digests[at : at + len(table)].reshape(groups, replicas, outer, blocks)
        out.append(np.ascontiguousarray(part[:, 0]))
        at += len(table)
    return out


class BlockPlan:
    """The geometry of a fixed list of moves that share one pair of block lists per call
    (a pool's per-array moves between its slots and the device pools), planned once.

    :func:`plan_segments` per move per call re-derives every piece's offset inside its region
    (docs/decisions/0004); here those offsets are kept, host regions (fixed memory) too, and a call
    only reads each device buffer's address (pinning it) and adds ``block * stride``, for all
    moves in one C pass (``_core.BlockRows``). Rows are in :func:`run_hashed`'s order: (move,
    shard group, replica, outer index, block). Device shard shapes never change (a DevicePool's
    shape and sharding are fixed), and neither do host views, so neither do the offsets.
    """

    def __init__(self, moves: list[Move]) -> None:
        self.moves = moves
        holds: list[Any] = []
        src_rel, dst_rel, src_step, dst_step = [], [], [], []
        nbytes, pair_of_row, first = [], [], []
        self._host_bases: list[int | None] = []  # per pair and side: fixed, or None (device)
        pair = 0
        rows_of_move = []
        for move in moves:
            rows_of_move.append(0)
            itemsize = move.src.dtype.itemsize
            src_regions = _regions(move.src, holds)
            dst_regions = _regions(move.dst, holds, written=True)
            for src_group, dst_group in zip(src_regions, dst_regions, strict=True):
                for replica, (s, d) in enumerate((src_group[0], t) for t in dst_group):
                    for side, region in ((move.src, s), (move.dst, d)):
                        fixed = isinstance(side, HostSide)
                        self._host_bases.append(region.base if fixed else None)
                    outer_s = strided_offsets(s.shape, s.strides, move.block_axis)
                    outer_d = strided_offsets(d.shape, d.strides, move.block_axis)
                    src_rel.append(outer_s)
                    dst_rel.append(outer_d)
                    rows = len(outer_s)
                    rows_of_move[-1] += rows
                    src_step.append(np.full(rows, s.strides[move.block_axis], np.int64))
                    dst_step.append(np.full(rows, d.strides[move.block_axis], np.int64))
                    nbytes.append(np.full(rows, block_bytes(s.shape, itemsize, move.block_axis)))
                    pair_of_row.append(np.full(rows, pair, np.int64))
                    first.append(np.full(rows, replica == 0))
                    pair += 1
        del holds

        def join(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
            return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)

        self._rows = _core.BlockRows(
            join(pair_of_row, np.int64),
            join(src_rel, np.int64),
            join(src_step, np.int64),
            join(dst_rel, np.int64),
            join(dst_step, np.int64),
            join(nbytes, np.uint64),
            pair,
        )
        self._first_rows = np.flatnonzero(join(first, bool)).astype(np.int64)
        # where each move's rows start in a call's table (times the blocks listed)
        self._move_bounds = [0, *np.cumsum(rows_of_move).tolist()]
        self.pieces = len(self._first_rows)  # piece checksums per block
        # the pools these moves write (device destinations), for the donated identity step
        pools = {id(m.dst.pool): m.dst.pool for m in moves if isinstance(m.dst, DeviceSide)}
        self.destination_pools = [pool for pool in pools.values() if pool is not None]
        # Where each device buffer's address goes in the per-pair bases (pair p: 2p source,
        # 2p + 1 destination): a side on one device fills one place; others, per (shard
        # group, replica) place, read replica 0 of a source group (read once).
        self._base_template = np.array([b or 0 for b in self._host_bases], dtype=np.int64)
        self._device_places: list[
            tuple[DeviceSide, int | None, list[tuple[int, int, int]], bool]
        ] = []
        at = 0
        for move in moves:
            groups = len(move.groups())
            replicas = [
                len(move.dst.groups[g].devices) if isinstance(move.dst, DeviceSide) else 1
                for g in range(groups)
            ]
            for which, side in ((0, move.src), (1, move.dst)):
                if not isinstance(side, DeviceSide):
                    continue
                places, spot = [], at + which
                written = which == 1
                for g in range(groups):
                    for r in range(replicas[g]):
                        places.append((g, r if which else 0, spot))
                        spot += 2
                single = (
                    len(places) == 1
                    and len(side.groups) == 1
                    and len(side.array.sharding.device_set) == 1
                )
                # a plain-CPU destination of one shard is addressed without a pin (see table)
                unpinned = single and written and side.groups[0].devices[0].platform == "cpu"
                self._device_places.append(
                    (side, places[0][2] if single else None, places, written, unpinned)
                )
            at += 2 * sum(replicas)
        if at != len(self._host_bases):
            raise AssertionError("BlockPlan: device places disagree with the planned pairs")

    def table(self, src_blocks: np.ndarray, dst_blocks: np.ndarray, holds: list[Any]) -> np.ndarray:
        """The segment table for this call's blocks; every device buffer it addresses is
        pinned in ``holds``, except a destination on the plain CPU path: call it right after
        :func:`wait_for_readers` with the pools locked, when only the locked pool refers to its
        new array, so that nothing can free or donate that buffer before the locks go."""
        bases = self._base_template.copy()
        plain = not pjrt.any_bound()  # CPU buffers are host memory (see _hold)
        for side, single, places, written, unpinned in self._device_places:
            if unpinned and plain:  # a pin is costly right after a model step (0004)
                try:
                    bases[single] = side.array.unsafe_buffer_pointer()
                except jax.errors.JaxRuntimeError:  # the race of _pinned_address: pin it
                    bases[single] = _hold(holds, side.array, side.groups[0].devices[0], written)
            elif single is not None:  # one shard: the array is its data
                bases[single] = _hold(holds, side.array, side.groups[0].devices[0], written)
            else:
                addresses = _device_bases(side, holds, written)
                for g, r, place in places:
                    bases[place] = addresses[g][r]
        return self._rows.rows(
            bases.reshape(-1, 2),
            np.ascontiguousarray(src_blocks, dtype=np.int64),
            np.ascontiguousarray(dst_blocks, dtype=np.int64),
        )


def _device_bases(side: DeviceSide, holds: list[Any], written: bool) -> list[list[int]]:
    """Per shard group, each replica's buffer address (in the group's device order), every
    buffer pinned in ``holds``: :func:`_device_regions` without the geometry."""
    array = side.array
    if len(side.groups) == 1 and len(array.sharding.device_set) == 1:
        # one shard: the array is its data
        return [[_hold(holds, array, side.groups[0].devices[0], written)]]
    by_device = {shard.device: shard.data for shard in array.addressable_shards}
    return [
        [_hold(holds, by_device[device], device, written) for device in group.devices]
        for group in side.groups
    ]


def run_hashed_plan(
    plan: BlockPlan,
    src_blocks: np.ndarray,
    dst_blocks: np.ndarray,
    *,
    donated: bool = False,
    after_move: Callable[[int], None] | None = None,
) -> np.ndarray:
    """Runs the plan's moves with these block lists and returns each block's checksum: XXH64 of
    its pieces' checksums (``_core.sum64`` of the bytes copied) in (move, shard group, outer
    index) order, the first replica of each group (a slot's order: see slot_checksums).
    ``donated``: the caller already started the destination pools' donation (under the locks
    it still holds); only its wait is left. ``after_move``: the moves run one after another,
    in order, and ``after_move(i)`` is called once move ``i``'s bytes are in place (a reader
    of that destination may start while the later moves run)."""
    n = len(src_blocks)
    if not n:
        if donated:
            wait_for_readers(plan.destination_pools, started=True)
        for i in range(len(plan.moves) if after_move is not None else 0):
            after_move(i)  # type: ignore[misc]
        return np.zeros(0, np.uint64)
    wait_for_readers(plan.destination_pools, started=donated)
    holds = Holds()
    try:
        table = plan.table(src_blocks, dst_blocks, holds)
        if overlaps(table):
            raise ValueError("hashed copies need sources and destinations that do not overlap")
        if after_move is None:
            digests = _copy_hashed(table, holds) if len(table) else np.zeros(0, np.uint64)
        else:
            parts = []
            bounds = plan._move_bounds
            for i in range(len(plan.moves)):
                rows = table[bounds[i] * n : bounds[i + 1] * n]
                parts.append(_copy_hashed(rows, holds) if len(rows) else np.zeros(0, np.uint64))
                after_move(i)
            digests = np.concatenate(parts)
    finally:
        del holds
    return _core.xxh64_gathered(digests, plan._first_rows, n)


def overlaps(table: np.ndarray) -> bool:
    """Whether any source range of a segment table intersects any destination range (exact).

    Destination ranges are disjoint (destination blocks never repeat), so after sorting them a
    source range can only meet the last destination range that starts before it ends.
    """
    if len(table) == 0:
        return False
    src_lo, src_hi, dst_lo, dst_hi = _core.table_bounds(np.ascontiguousarray(table, np.uint64))
    if src_hi <= dst_lo or src_lo >= dst_hi:
        return False  # the usual case (host slots and device buffers): one range each side
    src_start = table[:, 0]
    src_end = src_start + table[:, 2]
    order = np.argsort(table[:, 1], kind="stable")
    dst_start = table[order, 1]
    dst_end = dst_start + table[order, 2]
    last = np.searchsorted(dst_start, src_end, side="left").astype(np.int64) - 1
    hit = last >= 0
    return bool(np.any(dst_end[last[hit]] > src_start[hit]))


def _copy_staged(table: np.ndarray) -> int:
    """Copies through a temporary buffer: every source is read before any destination is
    written, so overlapping blocks (e.g. a swap inside one pool) move like the pure-JAX path."""
    lengths = table[:, 2]
    offsets = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.uint64)
    staging = _core.Mapping(max(int(lengths.sum()), 1), populate=False)
    base = np.uint64(staging.address)
    gather = np.stack([table[:, 0], base + offsets, lengths], axis=1)
    scatter = np.stack([base + offsets, table[:, 1], lengths], axis=1)
    engine().copy(np.ascontiguousarray(gather))
    copied = int(engine().copy(np.ascontiguousarray(scatter)))
    staging.close()
    return copied


def run(moves: list[Move]) -> int:
    """Moves every pair with one native call; pools' locks must be held by the caller.

    Pairs of a batch whose sources and destinations share no bytes run as one parallel job.
    Where they do (a copy inside one pool or one host array), the pairs run one after another,
    each through a staging buffer where it overlaps itself: the same result as the pure-JAX
    path, which runs pairs in order.
    """
    _prepare_destinations(moves)
    holds = Holds()
    try:
        tables = []
        memo: dict[Any, Any] = {}
        for move in moves:
            parts = plan_segments(move, holds, memo=memo)
            tables.append(np.concatenate(parts) if parts else np.empty((0, 3), np.uint64))
        whole = np.concatenate(tables) if tables else np.empty((0, 3), np.uint64)
        if not overlaps(whole):
            return _copy(whole, holds)
        if holds.device_buffers:
            # a batch that reads and writes the same device blocks: its pairs in order, as the
            # pure-JAX path runs them (one pair never overlaps itself here: device-to-device
            # pairs run in JAX)
            return sum(_copy(table, holds) for table in tables)
        return sum(
            _copy_staged(table) if overlaps(table) else int(engine().copy(table))
            for table in tables
        )
    finally:
        del holds


def unavailable_reason(array: jax.Array, write: bool = False, explicit: bool = False) -> str | None:
    """Why the native engine cannot read (or, with ``write``, write) this array, or None if
    it can. ``explicit``: the caller asked for path="native", which may use a PJRT engine that
    path="auto" does not pick yet (unproven on the platform's hardware)."""
    for device in array.sharding.device_set:
        path = device_path(device)
        if not (path.native or (explicit and path.engine == "pjrt")):
            return path.reason
        if write and not path.writes:
            return f"{path.reason} (no in-place writes on {device.platform})"
    dtype = np.dtype(array.dtype)
    if getattr(dtype, "itemsize", 0) == 0 or _is_sub_byte(dtype):
        return f"dtype {dtype} is packed below one byte on device: pure JAX"
    facts = _layout_facts(array)
    if facts is None:
        if pjrt_device(array):  # raw bytes mean nothing without knowing the layout
            return "the device layout cannot be read: pure JAX"
        return None
    order, tiling = facts
    if order != tuple(range(array.ndim)):
        return f"non-default device layout {order}: pure JAX"
    if tiling:  # e.g. TPU's (8, 128) tiles: a block's bytes are not row-major
        return f"tiled device layout {tiling}: pure JAX"
    return None


def pjrt_device(array: jax.Array) -> bool:
    """Whether the array lives on devices served through a PJRT plugin (not raw CPU memory)."""
    return any(pjrt_device_of(d) for d in array.sharding.device_set)


def pjrt_device_of(device: Any) -> bool:
    """Whether a device is served through a PJRT plugin (not raw CPU memory)."""
    return device_path(device).engine == "pjrt"


_LAYOUTS: dict[Any, tuple[tuple[int, ...], tuple[Any, ...]]] = {}


def _layout_facts(array: jax.Array) -> tuple[tuple[int, ...], tuple[Any, ...]] | None:
    """The array's device layout as (major-to-minor axes, tiles), or None when the backend
    says nothing.

    ``Array.format`` builds Python layout objects; the PJRT layout it is made from is cheaper
    and hashes by value, so its answer is kept per layout (docs/decisions/0004)."""
    pjrt_layout = getattr(array, "_pjrt_layout", None)  # private: fall back to .format
    if pjrt_layout is not None:
        try:
            facts = _LAYOUTS.get(pjrt_layout)
            if facts is None:
                xla = pjrt_layout._xla_layout()
                facts = (
                    tuple(xla.minor_to_major()[::-1]),
                    tuple(tuple(t) for t in xla.tiling()),
                )
                if len(_LAYOUTS) < 1024:
                    _LAYOUTS[pjrt_layout] = facts
            return facts
        except Exception:  # e.g. UNIMPLEMENTED on some backends: ask .format
            pass
    layout = getattr(getattr(array, "format", None), "layout", None)
    order = getattr(layout, "major_to_minor", None)
    if order is None:
        return None
    return tuple(order), tuple(getattr(layout, "tiling", ()) or ())


def _is_sub_byte(dtype: np.dtype) -> bool:
    for info in (ml_dtypes.finfo, ml_dtypes.iinfo):
        try:
            return bool(info(dtype).bits < 8)
        except (TypeError, ValueError):
            continue
    return False


def pool_unavailable_reason(pool: DevicePool, write: bool = True) -> str | None:
    """Why this engine cannot read (or, with ``write``, write) the pool's array, or None. Call
    with the pool's lock held.

    An updated array keeps the pool's devices and dtype (update() checks), so only its device
    layout can change the answer: the pool keeps the answer while the layout compares equal (a
    cheap read, where the full check is costly right after a step: docs/decisions/0004)."""
    array = current_array(pool)
    layout = device_layout(array)
    notes = engine_notes(pool)
    known = notes.get("native")  # (device layout, (read reason, write reason))
    if known is None or layout is None or layout != known[0]:
        known = (layout, (unavailable_reason(array), unavailable_reason(array, write=True)))
        notes["native"] = known
    return known[1][1 if write else 0]


class NativeEngine:
    """The native engine as an :class:`~tpusync._src.engines.base.Engine`."""

    name = "native"

    def unavailable(self, move: Move, *, explicit: bool) -> list[str]:
        reasons = []
        for side in (move.src, move.dst):
            if isinstance(side, DeviceSide):
                reason = unavailable_reason(side.array, side is move.dst, explicit)
                if reason:
                    reasons.append(f"{side.argument}: {reason}")
        if (
            isinstance(move.src, DeviceSide)
            and isinstance(move.dst, DeviceSide)
            and pjrt_device(move.src.array)
        ):
            reasons.append("dst: device-to-device copies on a PJRT backend run in JAX")
        return reasons

    def run(self, moves: list[Move]) -> int:
        return run(moves)  # looked up at call time: tests may count the module's run


ENGINE = NativeEngine()
