"""HostPool: the DRAM tier — page-aligned slots in anonymous memory or in /dev/shm.

Given a name, the pool lives in ``/dev/shm/tpusync-<name>.pool`` and survives the process: a
restarted server re-attaches in O(index) time and finds every committed block again. One process
owns a named pool at a time (a ``flock`` the kernel releases when the owner dies); a second one
gets :class:`~tpusync.errors.PoolBusyError`.

Ownership and pins: :meth:`HostPool.put_from_device` copies device blocks into free slots and
commits them; :meth:`HostPool.get_to_device` pins the slots it reads for the duration of the copy,
so a concurrent :meth:`HostPool.delete` skips them. Every block is verified against its checksum
on the way out, in the same pass as the copy; a mismatch is a miss (counted, and the block is
dropped), never data.
"""

from __future__ import annotations

import _thread
import contextlib
import functools
import logging
import numbers
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpusync._native import core as _core
from tpusync._src.engines import native
from tpusync._src.engines.pjrt import engine as pjrt
from tpusync._src.memory import dma, fork_guard, huge_pages
from tpusync._src.memory.deferred_refs import close_releasing_deferred_views
from tpusync._src.memory.device_pool import DevicePool, current_array, devices_of
from tpusync._src.memory.torch_tensors import TorchPool
from tpusync._src.tiers._keys import check_keys
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.tiers.dram._pool_open import (
    ON_MISMATCH,
    check_before_opening,
    open_named_pool,
    write_header,
)
from tpusync._src.tiers.dram._prefault import prefault
from tpusync._src.tiers.dram._records import SlotRecords
from tpusync._src.tiers.dram._shm_files import DEFAULT_SHM_DIR, POOL_NAME, pool_path
from tpusync._src.tiers.dram.pool_file import RECORD_DTYPE, PoolGeometry
from tpusync._src.tiers.dram.slot_pages import SlotPages
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.slots import Pinned, Reservation
from tpusync._src.tiers.stats import TierStats
from tpusync._src.transfer.slot_moves import SlotMover
from tpusync.errors import BlockIndexError, BlocksMissingError, InvalidArgumentError

__all__ = ["HostPool", "Pinned", "Reservation"]

log = logging.getLogger("tpusync.tiers")


class HostPool(SlotRecords):
    """The DRAM tier: ``capacity`` slots of ``layout.slot_bytes`` each.

    Args:
      layout: the block format (see :class:`~tpusync.tiers.PoolLayout`).
      capacity: number of slots (blocks).
      name: None for anonymous memory (gone with the process); a name to live in
        ``shm_dir`` and survive restarts.
      shm_dir: where named pools live (default /dev/shm): a directory (not a symlink) of this
        uid or root that others may write only if it is sticky, as /dev/shm is; anything else
        is refused before a file is made (:func:`tpusync._src.tiers.files.check_shm_dir`).
      on_mismatch: what to do with an existing named pool of another model, block layout or
        size, or one that is damaged or of another format, whose owner is gone: ``"error"``
        (refuse with :class:`~tpusync.errors.PoolFormatError`, naming what differs, and leave
        it as it is) or ``"recreate"`` (log a warning, delete it and start a cold pool in its
        place). A path that is no safe regular file (a FIFO, a directory, a link, another
        user's file) is always refused (:class:`~tpusync.errors.UnsafeFileError`).
      populate: touch every page at creation so copies never pay page faults.
      collapse: collapse a named pool's /dev/shm pages into huge pages on a background thread
        (see :mod:`tpusync._src.memory.huge_pages`): scattered block copies miss the TLB less. The
        collapse costs CPU time for every MiB, and another process that maps the collapsed file
        with small pages reads it slower (decisions 0007, 0010): False
        for a pool read that way in long runs (the weights publisher's).
    """

    def __init__(
        self,
        layout: PoolLayout,
        capacity: int,
        *,
        name: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        on_mismatch: str = "error",
        populate: bool = True,
        collapse: bool = True,
    ) -> None:
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or capacity < 1:
            raise InvalidArgumentError(
                f"capacity: expected a positive number of slots, got {capacity!r}"
            )
        capacity = int(capacity)
        if on_mismatch not in ON_MISMATCH:
            raise InvalidArgumentError(
                f"on_mismatch: expected 'error' or 'recreate', got {on_mismatch!r}"
            )
        if name is not None and (not isinstance(name, str) or not POOL_NAME.match(name)):
            raise InvalidArgumentError(
                f"name: {name!r} must be letters, digits, '.', '_' or '-' (at most 101)"
            )
        geometry = PoolGeometry(layout, capacity)
        check_before_opening(geometry, name, shm_dir)  # before anything is mapped or made
        self.layout = layout
        self.capacity = capacity
        self.name = name
        self.geometry = geometry
        self.stats = TierStats(f"dram:{name or 'anonymous'}")
        self._lock = threading.Lock()
        self._fd = -1
        self.path: Path | None = None
        self.attached = False  # True when an existing pool was re-attached
        self.attach_seconds = 0.0
        if name is None:
            # Transparent huge pages where the kernel allows (advice, as numpy gives its large
            # arrays): scattered block copies then miss the TLB far less (decision 0001).
            self._mapping = _core.Mapping(self.geometry.file_bytes, populate=False, huge_pages=True)
            if populate:
                prefault(self._mapping, "prefaulting host pool")
            write_header(self._mapping, self.geometry)
        else:
            self.path = pool_path(name, shm_dir)
            self._open_named(name, populate, on_mismatch)
        # Every view of the pool is built on this base array, which holds a buffer export of
        # the mapping: while any view lives, the mapping refuses to unmap (no dangling views).
        self._base: np.ndarray | None = np.frombuffer(self._mapping, dtype=np.uint8)
        self._records = np.ndarray(
            (capacity,), RECORD_DTYPE, buffer=self._base, offset=self.geometry.records_offset
        )
        self._index: dict[bytes, int] = {}
        self._pins = np.zeros(capacity, dtype=np.int64)
        self._writing: set[bytes] = set()
        self._retired: set[int] = set()  # dropped while pinned: freed by the last unpin
        self._sequence = 0
        try:
            self._free = self._scan_records()
        except BaseException:  # (never expected) no mapping nor lock outlives a failed open
            self._base = self._records = None  # type: ignore[assignment]
            self._mapping.close()
            if self._fd >= 0:
                os.close(self._fd)
            raise
        self._last_pools: tuple[tuple[weakref.ref[Any], ...], int] | None = None
        # Slots whose pages are mapped: all of a pool created with populate=True; none of a
        # re-attached one (its pages exist in /dev/shm but this process has not mapped them;
        # a copy maps the slots it touches in one call first, instead of a fault per page).
        self._pages = SlotPages(
            capacity,
            layout.slot_bytes,
            self.geometry.data_offset,
            # /dev/shm pages exist (allocated at creation): mapping them to read is cheaper;
            # anonymous memory has no pages until written (the mapping, not self: no cycle)
            functools.partial(self._mapping.populate, write=self.path is None),
            mapped=populate and not self.attached,
        )
        self._mapper_stop = threading.Event()
        self._mapper_done: threading.Event | None = None
        if self.attached and populate:
            # Map the re-attached pool's pages in the background, so that the first requests
            # after a restart do not pay for it (a copy maps what it needs itself meanwhile).
            # A raw thread: threading.Thread.start() waits for the new thread to run, which
            # cost milliseconds of the attach on 2 busy cores.
            self._mapper_done = threading.Event()
            _thread.start_new_thread(self._map_in_background, (self._mapper_done,))
        self._mover = SlotMover(
            self.views,
            [array.block_axis for array in self.layout.arrays],
            self._hash_slots,
            slot_checksums,
        )
        if self.path is not None and collapse:
            # /dev/shm's tmpfs allocates small pages (unless mounted with huge=): collapse them
            # in the background, as for device pools (see memory.huge_pages), once the records are
            # read (the worker would slow their page faults). Once collapsed, the file's huge
            # pages are what a restarted process re-attaches to.
            huge_pages.collapse_range_later(self._mapping.address, self._mapping.size)
        # registered for DMA with a PJRT device runtime on first use there (pinned copies)
        dma.offer_for_dma(self._mapping)

    def wait_mapped(self, timeout: float | None = None) -> bool:
        """Waits until every slot's pages are mapped in this process (a re-attached pool maps
        them on a background thread; one opened with ``populate=False`` maps them here, now),
        so that no later copy pays for it. False on timeout."""
        done = self._mapper_done
        if done is not None and not done.wait(timeout):
            return False
        self._ensure_populated(np.arange(self.capacity))
        return True

    # --- opening ---------------------------------------------------------------------------

    def _open_named(self, name: str, populate: bool, on_mismatch: str) -> None:
        assert self.path is not None
        start = time.perf_counter()
        opened = open_named_pool(
            self.path,
            name,
            self.geometry,
            populate=prefault if populate else None,
            on_mismatch=on_mismatch,
        )
        self._fd, self._mapping, self.attached = opened.fd, opened.mapping, opened.attached
        if self.attached:
            write_header(self._mapping, self.geometry)  # this process owns it now
            self.attach_seconds = time.perf_counter() - start

    # --- queries ---------------------------------------------------------------------------

    def views(self, n_slots: int | None = None) -> list[np.ndarray]:
        """Each array's part of every slot, as transfer()'s strided host arrays."""
        n = self.capacity if n_slots is None else n_slots
        base = self._open_base()
        return [
            self.layout.host_view(base, i, n, offset=self.geometry.data_offset)
            for i in range(len(self.layout.arrays))
        ]

    # --- put ----------------------------------------------------------------------------------

    def put_from_device(
        self,
        keys: Sequence[bytes],
        pools: Sequence[DevicePool | jax.Array],
        block_ids: Sequence[int] | np.ndarray,
        *,
        path: str = "auto",
    ) -> int:
        """Copies device blocks ``block_ids[i]`` of every array in ``pools`` (in the layout's
        order) into the pool under ``keys[i]``; returns how many blocks were stored.

        Keys already present are skipped (their blocks are not copied again). Raises
        :class:`~tpusync.errors.TierFullError` before anything moves when too few slots are
        free: the caller evicts first.
        """
        keys = check_keys(keys)
        block_ids = self._check_device_side(pools, block_ids, unique=False)
        if len(block_ids) != len(keys):
            raise InvalidArgumentError(
                f"block_ids: {len(block_ids)} block ids for {len(keys)} keys; give one per key"
            )
        reservation = self._reserve_checked(keys)
        if not len(reservation.slots):
            return 0
        try:
            checksums = self._copy_in(
                pools, block_ids[reservation.indices], reservation.slots, path
            )
        except BaseException:
            self.abort(reservation)
            raise
        self.commit(reservation, checksums)
        return len(reservation.slots)

    # --- the lower-tier interface: slot to slot with another DRAM pool --------------------

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        """Stores ``source``'s blocks under ``keys`` here, slot to slot (the same interface as
        every lower tier: a DRAM pool can sit below another one). Returns how many blocks were
        stored; keys already here are skipped. Every block is checksummed in the copy and
        stored only if it matches the checksum ``source`` recorded.

        Raises :class:`~tpusync.errors.BlocksMissingError` before storing anything when a key
        is absent from ``source`` or its block fails its checksum there (that block is dropped
        from ``source``), and :class:`~tpusync.errors.TierFullError` when too few slots are
        free here.
        """
        keys = check_keys(keys)
        self._check_peer(source, "source")
        unique = list(dict.fromkeys(keys))
        pinned = source._pin_checked(unique)
        try:
            if not pinned.present.all():
                absent = [k for k, ok in zip(unique, pinned.present, strict=True) if not ok]
                missing = set(absent)
                raise BlocksMissingError(
                    f"keys: {len(absent)} of {len(unique)} keys are not in source "
                    f"(e.g. {absent[0].hex()}); nothing was stored",
                    loaded=[k not in missing for k in keys],
                )
            reservation = self._reserve_checked(unique)
            if not len(reservation.slots):
                return 0
            try:
                expected = pinned.checksums[reservation.indices]
                got = _copy_slots(source, pinned.slots[reservation.indices], self, reservation)
                bad = got != expected
                if bad.any():
                    corrupt = [k for k, b in zip(reservation.keys, bad, strict=True) if b]
                    source.drop_corrupt(corrupt)
                    raise BlocksMissingError(
                        f"source: {len(corrupt)} blocks failed their checksum there (dropped "
                        "from it); nothing was stored",
                        loaded=[k not in set(corrupt) for k in keys],
                        corrupt=len(corrupt),
                    )
            except BaseException:
                self.abort(reservation)
                raise
            self.commit(reservation, expected)
            return len(reservation.slots)
        finally:
            source.unpin(pinned)

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Loads the blocks under ``keys`` into ``target``, slot to slot, each verified against
        its checksum over the bytes copied (keys already in ``target`` count as loaded). Raises
        :class:`~tpusync.errors.BlocksMissingError` (``loaded`` mask over ``keys``) after
        committing every good block when any is absent or corrupt (a corrupt block is dropped
        from this pool), and :class:`~tpusync.errors.TierFullError` before copying when
        ``target`` has too few free slots."""
        keys = check_keys(keys)
        self._check_peer(target, "target")
        pinned = self._pin_checked(keys)
        corrupt: list[bytes] = []
        try:
            want = [i for i, ok in enumerate(pinned.present.tolist()) if ok]
            reservation = target._reserve_checked([keys[i] for i in want])
            if len(reservation.slots):
                picked = np.array(want, dtype=np.int64)[reservation.indices]
                expected = pinned.checksums[picked]
                try:
                    got = _copy_slots(self, pinned.slots[picked], target, reservation)
                except BaseException:
                    target.abort(reservation)
                    raise
                ok = got == expected
                target.abort(reservation.subset(~ok))
                good = reservation.subset(ok)
                target.commit(good, expected[ok])
                corrupt = [k for k, fine in zip(reservation.keys, ok, strict=True) if not fine]
        finally:
            self.unpin(pinned)
        if corrupt:
            self.drop_corrupt(corrupt)
        loaded = target.contains_checked(keys)
        self._served(loaded, len(keys) - sum(loaded) - len(corrupt), len(corrupt))

    def _check_peer(self, pool: Any, argument: str) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(
                f"{argument}: expected a HostPool, got {type(pool).__name__}"
            )
        if pool is self:
            raise InvalidArgumentError(f"{argument}: a pool cannot copy blocks into itself")
        if pool.layout.fingerprint != self.layout.fingerprint:
            raise InvalidArgumentError(
                f"{argument}: a pool of another block layout ({pool.layout.model_id!r}); "
                "blocks move only between pools of one layout"
            )

    # --- the slot interface other tiers use (see SlotRecords for the rest) ------------------

    def slot_memory(self, slot: int) -> memoryview:
        """The writable bytes of one slot (``layout.slot_bytes``, page-aligned) for file I/O.
        Release the view (``with`` or ``.release()``) when done: :meth:`close` refuses while
        views of the pool's memory are alive."""
        if not 0 <= int(slot) < self.capacity:
            raise InvalidArgumentError(f"slot: {slot} is out of range 0..{self.capacity - 1}")
        self._ensure_populated(np.array([int(slot)]))
        start = self.geometry.data_offset + int(slot) * self.layout.slot_bytes
        return memoryview(self._open_base())[start : start + self.layout.slot_bytes]

    @contextlib.contextmanager
    def slot_addresses(self, slots: np.ndarray) -> Iterator[np.ndarray]:
        """The memory addresses (uint64) of ``slots`` (``layout.slot_bytes`` each, page-aligned)
        for native file I/O, valid inside the ``with``: :meth:`close` refuses while it is
        open, as for :meth:`slot_memory`."""
        slots = self._slots_in_range(slots)
        self._ensure_populated(slots)
        with memoryview(self._open_base()):  # keeps the mapping open (see slot_memory)
            base = self._mapping.address + self.geometry.data_offset
            yield (base + slots * self.layout.slot_bytes).astype(np.uint64)

    def hash_slots(self, slots: np.ndarray | Sequence[int], *, inline: bool = False) -> np.ndarray:
        """Each slot's block checksum, computed from its bytes in memory; ``inline`` hashes on
        the calling thread instead of the copy engine's (for a block or two, from several
        threads at once: the engine runs one job at a time)."""
        return self._hash_slots(self._slots_in_range(slots), inline=inline)

    def _slots_in_range(self, slots: np.ndarray | Sequence[int]) -> np.ndarray:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        if slots.size and (slots.min() < 0 or slots.max() >= self.capacity):
            raise InvalidArgumentError(
                f"slots: out of range 0..{self.capacity - 1} ({int(slots.min())}..."
                f"{int(slots.max())})"
            )
        return slots

    def _copy_in(
        self, pools: Sequence[Any], block_ids: np.ndarray, slots: np.ndarray, path: str
    ) -> np.ndarray:
        return self._move_blocks(pools, block_ids, slots, path, to_device=False)

    def _hash_slots(self, slots: np.ndarray, *, inline: bool = False) -> np.ndarray:
        """Checksums of committed-or-written slots, from memory (the pure-JAX path's pass)."""
        self._open_base()
        offsets, lengths = self.layout.piece_table
        base = self._mapping.address + self.geometry.data_offset
        starts = base + slots[:, None] * self.layout.slot_bytes + offsets[None, :]
        if inline:
            digests = _core.sum64_regions(
                starts.ravel().astype(np.uint64), np.tile(lengths, len(slots)).astype(np.uint64)
            )
            return slot_checksums(digests.reshape(len(slots), len(offsets)))
        table = np.stack(
            [starts.ravel(), np.zeros(starts.size, np.int64), np.tile(lengths, len(slots))], 1
        ).astype(np.uint64)
        digests = native.engine().hash(table).reshape(len(slots), len(offsets))
        return slot_checksums(digests)

    # --- get ----------------------------------------------------------------------------------

    def get_to_device(
        self,
        keys: Sequence[bytes],
        pools: Sequence[DevicePool],
        block_ids: Sequence[int] | np.ndarray,
        *,
        path: str = "auto",
    ) -> None:
        """Loads the blocks under ``keys`` into device blocks ``block_ids`` of every pool.

        Every block is checked against its checksum over the bytes copied. Raises
        :class:`~tpusync.errors.BlocksMissingError` (with a ``loaded`` mask) when any key is
        absent or fails its checksum; the blocks marked loaded are valid, the others must be
        recomputed. A corrupt block is dropped from the pool.
        """
        keys = check_keys(keys)
        block_ids = self._check_device_side(pools, block_ids, unique=True)
        if len(block_ids) != len(keys):
            raise InvalidArgumentError(
                f"block_ids: {len(block_ids)} block ids for {len(keys)} keys; give one per key"
            )
        self.get_to_device_checked(keys, pools, block_ids, path)

    def get_to_device_checked(
        self,
        keys: list[bytes],
        pools: Sequence[DevicePool],
        block_ids: np.ndarray,
        path: str,
        after_array: Callable[[int], None] | None = None,
    ) -> None:
        """:meth:`get_to_device` of arguments already checked: keys as :func:`check_keys`
        answers them, the layout's pools, and unique int64 block ids in range (the KV store
        checks its own once per load). ``after_array(i)``: called once pool ``i``'s blocks are
        written, before their checksums are compared (a layer-by-layer load)."""
        pinned = self._pin_checked(keys)
        present = pinned.present
        loaded = present.copy()
        corrupt = 0
        try:
            if pinned.all_present:  # the usual load: no masks to apply
                got = self._move_blocks(
                    pools, block_ids, pinned.slots, path, to_device=True, after=after_array
                )
                # one C compare: numpy's != and any() cost more right after a step (0004)
                expected = pinned.checksums
                bad = None if got.tobytes() == expected.tobytes() else got != expected
            elif present.any():
                got = self._move_blocks(
                    pools,
                    block_ids[present],
                    pinned.slots[present],
                    path,
                    to_device=True,
                    after=after_array,
                )
                bad = got != pinned.checksums[present]
            else:
                bad = None
            if bad is not None and bad.any():
                corrupt = int(bad.sum())
                loaded[np.flatnonzero(present)[bad]] = False
        finally:
            self.unpin(pinned)
        if corrupt:
            self.drop_corrupt(
                [k for k, p, ok in zip(keys, present, loaded, strict=True) if p and not ok]
            )
        if pinned.all_present and not corrupt:
            self.stats.served(len(keys), 0, len(keys) * self.layout.payload_bytes)
            return
        self._served(loaded, int((~present).sum()), corrupt)

    def _served(self, loaded: np.ndarray | list[bool], absent: int, corrupt: int) -> None:
        """Counts a get's hits and misses; raises BlocksMissingError (with ``loaded`` per key)
        unless every block was served."""
        hits, wanted = int(np.count_nonzero(loaded)), len(loaded)
        self.stats.served(hits, wanted - hits, hits * self.layout.payload_bytes)
        if hits < wanted:
            raise BlocksMissingError(
                f"keys: {wanted - hits} of {wanted} blocks not served "
                f"({absent} absent, {corrupt} failed their checksum)",
                loaded=np.asarray(loaded, dtype=bool).tolist(),
                corrupt=corrupt,
            )

    def _move_blocks(
        self,
        pools: Sequence[Any],
        block_ids: np.ndarray,
        slots: np.ndarray,
        path: str,
        *,
        to_device: bool,
        after: Callable[[int], None] | None = None,
    ) -> np.ndarray:
        """:meth:`SlotMover.move <tpusync._src.transfer.slot_moves.SlotMover.move>`, after the
        fork check and with the slots' pages mapped."""
        fork_guard.check_device_use("pools")  # before the pools' locks: see memory.fork_guard
        self._ensure_populated(slots)
        return self._mover.move(pools, block_ids, slots, path, to_device=to_device, after=after)

    def _map_in_background(self, done: threading.Event) -> None:
        try:
            for slots in self._pages.steps(64 << 20):  # 64 MiB a call: stops promptly
                if self._mapper_stop.is_set():
                    return
                self._pages.ensure(slots)
        except Exception:  # mapping is an optimisation: a copy maps what it needs itself
            log.debug("tpusync: background mapping of %s stopped", self.path, exc_info=True)
        finally:
            done.set()

    def _ensure_populated(self, slots: np.ndarray) -> None:
        """Maps the pages of ``slots`` not yet mapped, a run of neighbouring slots per call."""
        self._pages.ensure(slots)

    def prepare(self, pools: Sequence[DevicePool | TorchPool], *, wait_mapped: bool = True) -> None:
        """Does now, once, what the first move between ``pools`` (DevicePools or an engine's
        TorchPools) and the slots would pay for: plans the native moves in both directions,
        starts the copy engine, compiles the DevicePools' donated identity step and maps every
        slot's pages. Moves nothing; the first :meth:`put_from_device` and
        :meth:`get_to_device` after it run as fast as later ones (decision 0004).
        ``wait_mapped=False`` maps no page and
        waits for none: a re-attached pool's pages are left to its background mapper, and a
        pool opened with ``populate=False`` maps them on first use (for an engine's start-up,
        which must not wait for a large pool)."""
        self._check_device_side(pools, np.zeros(0, np.int64), unique=False)
        pools = list(pools)
        if not all(isinstance(pool, DevicePool | TorchPool) for pool in pools):
            raise InvalidArgumentError(
                "pools: prepare() plans moves of DevicePools or TorchPools; pass the pools "
                "loads write"
            )
        devices = self._mover.prepare(pools)
        if wait_mapped:
            self.wait_mapped()
        for device in {d for pool in devices for d in devices_of(pool)}:
            if native.pjrt_device_of(device):  # host memory registered for its DMA, if offered
                pjrt.prepare_dma(device, self._mapping)

    # --- close --------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmaps the pool and releases ownership; a named pool stays in /dev/shm.

        Refuses (and stays open) while views from :meth:`views` or :meth:`slot_memory` are
        alive, since they would point into unmapped memory."""
        if self._mapper_done is not None:  # it maps pages of the mapping about to go away
            self._mapper_stop.set()
            self._mapper_done.wait()
            self._mapper_done = None
        with self._lock:
            if self._base is None:
                return
            self._mover.forget()  # its plans hold views of the slots
            base, records = self._base, self._records
            self._base = self._records = None  # type: ignore[assignment]
            del base, records
            try:
                close_releasing_deferred_views(self._mapping.close)
            except BufferError:
                self._base = np.frombuffer(self._mapping, dtype=np.uint8)
                self._records = np.ndarray(
                    (self.capacity,),
                    RECORD_DTYPE,
                    buffer=self._base,
                    offset=self.geometry.records_offset,
                )
                raise InvalidArgumentError(
                    "close: views of this pool's memory are still alive (from views() or "
                    "slot_memory()); drop them first"
                ) from None
            if self._fd >= 0:
                os.close(self._fd)  # drops the flock
                self._fd = -1

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = str(self.path) if self.path else "anonymous"
        if self.closed:
            return f"HostPool({where}, closed)"
        return f"HostPool({where}, {self.used}/{self.capacity} slots of {self.layout.slot_bytes} B)"

    # --- helpers ----------------------------------------------------------------------------

    def _checked_count(self, pools: Sequence[Any]) -> int:
        """Checks the pools' layout against the pool's; returns their number of blocks. The
        answer for the last list of DevicePools is kept: a DevicePool's shape, dtype and
        sharding never change, so the same pools need no second check."""
        cached = self._last_pools
        if (
            cached is not None
            and len(cached[0]) == len(pools)
            and all(ref() is pool for ref, pool in zip(cached[0], pools, strict=True))
        ):
            return cached[1]
        other = PoolLayout.from_pools(
            self.layout.model_id,
            pools,
            block_axis=self.layout.arrays[0].block_axis,
            names=[a.name for a in self.layout.arrays],
        )
        if other.fingerprint != self.layout.fingerprint:
            raise InvalidArgumentError(
                "pools: these device arrays have another block layout than this pool "
                f"({[a.shard_block_shape for a in other.arrays]} vs "
                f"{[a.shard_block_shape for a in self.layout.arrays]})"
            )
        counts = {_num_blocks(p, self.layout.arrays[0].block_axis) for p in pools}
        if len(counts) != 1:
            raise InvalidArgumentError(
                f"pools: the arrays hold different numbers of blocks {sorted(counts)}"
            )
        (count,) = counts
        if all(isinstance(pool, DevicePool) for pool in pools):
            self._last_pools = (tuple(weakref.ref(pool) for pool in pools), count)
        return count

    def _check_device_side(
        self, pools: Sequence[Any], block_ids: Sequence[int] | np.ndarray, *, unique: bool
    ) -> np.ndarray:
        """Checks the device pools against the layout and the block ids against the pools;
        returns the block ids as int64."""
        fork_guard.check_device_use("pools")
        single = isinstance(pools, DevicePool | jax.Array | TorchPool)
        if single or len(pools) != len(self.layout.arrays):
            count = 1 if single else len(pools)
            raise InvalidArgumentError(
                f"pools: {count} arrays for a layout of {len(self.layout.arrays)}; pass a list "
                "with one per layout array, in the layout's order"
            )
        count = self._checked_count(pools)
        ids = np.asarray(block_ids)
        if ids.dtype == np.bool_ or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
            raise InvalidArgumentError(f"block_ids: expected integers, got dtype {ids.dtype}")
        ids = ids.astype(np.int64).reshape(-1)
        status = _core.block_ids_status(ids, count)
        if status == 1:
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise BlockIndexError(
                f"block_ids: {bad} is out of range for pools of {count} blocks (0..{count - 1})"
            )
        if unique and status == 2:
            raise BlockIndexError("block_ids: a device block appears twice; each is written once")
        return ids


def _copy_slots(
    source: HostPool, source_slots: np.ndarray, target: HostPool, reservation: Reservation
) -> np.ndarray:
    """Copies the payloads of ``source_slots`` into the reserved slots of ``target`` piece by
    piece on the copy engine, and returns each block's checksum over the bytes copied."""
    offsets, lengths = source.layout.piece_table
    target._ensure_populated(reservation.slots)
    source._ensure_populated(source_slots)
    slot_bytes = source.layout.slot_bytes
    src = source._mapping.address + source.geometry.data_offset
    dst = target._mapping.address + target.geometry.data_offset
    src_starts = src + source_slots[:, None] * slot_bytes + offsets[None, :]
    dst_starts = dst + reservation.slots[:, None] * slot_bytes + offsets[None, :]
    table = np.stack(
        [src_starts.ravel(), dst_starts.ravel(), np.tile(lengths, len(source_slots))], axis=1
    ).astype(np.uint64)
    digests = native.engine().copy_hashed(table)
    return slot_checksums(digests.reshape(len(source_slots), len(offsets)))


def _num_blocks(pool: DevicePool | jax.Array, block_axis: int) -> int:
    array = current_array(pool) if isinstance(pool, DevicePool) else pool
    return int(array.shape[block_axis])


def unlink_own_file(pool: HostPool) -> None:
    """Removes the file of a named pool this process has just created (and still locks), if
    its name still refers to it."""
    assert pool.path is not None
    with contextlib.suppress(OSError):
        if os.stat(pool.path).st_ino == os.fstat(pool._fd).st_ino:
            os.unlink(pool.path)


# What the data plane uses of a pool beside its public API (it sends slots' bytes from the
# pool's memory); this module is the one place outside the class that touches its fields.


def populate(pool: HostPool, slots: np.ndarray) -> None:
    """Maps the pages of ``slots`` not yet mapped (a run of neighbouring slots per call)."""
    pool._ensure_populated(slots)


def memory_base(pool: HostPool) -> Any:
    """The buffer of the pool's whole memory; the pool refuses to close while a view of it
    is held."""
    return pool._open_base()
