"""DiskPool: the local-SSD tier — slab files, direct I/O, an index that survives restarts.

Files in the pool's directory (format version 1)::

    tpusync-disk.lock     flock'ed by the owning process (its pid inside, informational)
    tpusync-disk.index    [header: 4096 B][records: capacity x 64 B]
    slab-000000.tpd ...   [slab header: 4096 B][slab_slots x layout.slot_bytes]

The index header holds a magic, the format version, the geometry (slot bytes, capacity, slots
per slab), a random pool id, the layout fingerprint and the layout's description (JSON), and a
CRC32 of itself. The records are the DRAM pool's (``tiers.dram.RECORD_DTYPE``): state
(FREE / WRITING / COMMITTED), key (1 to 32 bytes), payload length, checksum (the block checksum
of :meth:`HostPool.hash_slots`, over the payload bytes) and a commit sequence number. Slot ``s``
lives in slab ``s // slab_slots`` at byte ``4096 + (s % slab_slots) * slot_bytes``; every slab
header repeats the pool id, its own number, its geometry and the layout fingerprint, so a slab
of another pool or another layout is never read as one of ours. Slabs are created (and
preallocated with ``posix_fallocate``) when the pool first needs their slots.

Commit order of :meth:`DiskPool.put`, per batch:

1. each block's record is set to WRITING with its key (a buffered write, not synced);
2. the payloads are written from the DRAM slots (``pwritev``, native threads, O_DIRECT where
   the filesystem allows it);
3. ``durability="commit"``: ``fdatasync`` of every slab file written;
4. each record gets its checksum, length and sequence and the state COMMITTED, in one 64-byte
   write;
5. ``durability="commit"``: ``fdatasync`` of the index;
6. only then are the keys visible to :meth:`DiskPool.get`.

Guarantees:

* SIGKILL of the owner at any moment: the page cache keeps every completed write, a record is
  either still WRITING (freed on the next open: the block is absent, never torn) or COMMITTED
  with all of its payload in place.
* Power loss with ``durability="commit"``: every block whose ``put`` returned is there; a record
  that reached the disk as COMMITTED implies a durable payload (step 3 precedes step 4).
* Power loss with ``durability="none"`` (no fsyncs: faster): which writes reached the disk is up
  to the page cache; a record may be on disk without its payload. Such a block fails its checksum
  and is a miss.
* Always: every block read is verified against its recorded checksum over the bytes read into
  DRAM; a mismatch is a miss (counted in ``stats.checksum_failures``; the block is deleted). A
  deleted block's FREE state is not synced: after a power loss a deleted block may come back,
  whole and verified, or as a checksum miss if its slot was being rewritten.

Opening an existing pool of the same layout fingerprint and geometry re-attaches it: the records
are read (O(index), no payload is read), WRITING records are freed; a pool of another layout or
geometry, or a garbage index, means a cold start with a log line (or :class:`PoolFormatError`
with ``on_mismatch="error"``). A slab file that is missing, truncated or not ours loses only its
own blocks (logged), unless ``on_mismatch="error"``.

Files are opened through :mod:`tpusync._src.tiers._files` (no symlink followed, no blocking open, an
``fstat`` check): anything but a regular file of this uid that others cannot write at the
index's or a slab's path is damage like a bad header (a cold start, or the slab's blocks
dropped); with ``on_mismatch="error"``, and for a directory there, it is an
:class:`~tpusync.errors.UnsafeFileError` naming the path. The directory itself must be this
uid's, not writable by group or others, and not a symlink (its files are opened by path: a link
could be repointed after the check). Files are created 0600; a failure to create or
rewrite one while opening is a :class:`~tpusync.errors.TierFullError` or
:class:`~tpusync.errors.TierIOError` naming it, with no temporary file left.

Threads: a get's or a put's block I/O is one native call (``_core.file_runs``) that runs its
``preadv``/``pwritev`` calls on ``io_threads`` C threads with the GIL released throughout, so
several blocks are in flight and a busy Python thread (an engine's step loop) cannot hold up
each one's return; ``fdatasync`` runs on a small thread pool. Calls from several threads are
safe: an internal lock guards the index, I/O runs outside it, and blocks being read are pinned
(:meth:`delete` skips them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.memory.fork_guard import check_same_process
from tpusync._src.tiers._files import check_directory
from tpusync._src.tiers._keys import check_keys
from tpusync._src.tiers.base import BlockTier, Load, LoadStatus, SlotPool
from tpusync._src.tiers.blocks import MAX_KEY_BYTES
from tpusync._src.tiers.disk._io_jobs import choose_direct_io, run_jobs
from tpusync._src.tiers.disk._landing import StagingBuffers, lander, segments_of
from tpusync._src.tiers.disk._opening import DiskFiles
from tpusync._src.tiers.disk.file_format import (
    _SLAB_NAME,
    DEFAULT_IO_THREADS,
    HEADER_BYTES,
    INDEX_NAME,
    MAX_SLABS,
    MEMORY_PER_SLOT,
    RECORD_BYTES,
    _default_slab_slots,
    _is_int,
    _mib,
)
from tpusync._src.tiers.dram import COMMITTED, FREE, RECORD_DTYPE, WRITING
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.room import check_room, check_writable_directory, held_bytes
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.slots import Reservation
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import InvalidArgumentError, PoolClosedError, TierFullError

__all__ = ["HEADER_BYTES", "DiskPool", "check_disk_capacity"]

log = logging.getLogger("tpusync.tiers")


def check_disk_capacity(
    argument: str,
    capacity: int,
    slot_bytes: int,
    directory: str | os.PathLike[str] | None = None,
) -> None:
    """Refuses a disk pool of ``capacity`` slots of ``slot_bytes`` that this host cannot hold,
    before anything is allocated, naming ``argument``: its index in memory (about
    ``MEMORY_PER_SLOT`` bytes a slot) against the memory available and, with ``directory``
    (an existing directory: the pool's own, or where it will be made), its files against the
    free room of that filesystem, the pool's own files already there counted as room.
    Raises :class:`~tpusync.errors.TierFullError`."""
    fix = f"lower {argument} ({capacity} blocks of {slot_bytes} B)"
    if capacity * MEMORY_PER_SLOT > sys.maxsize:  # beyond any host, even where memory is unknown
        raise TierFullError(
            f"{argument}: {capacity} blocks are more than a process can index; {fix}"
        )
    check_room(argument, capacity * MEMORY_PER_SLOT, fix=f"{fix}: its index is kept in memory")
    if directory is None:
        return
    own = [Path(directory) / INDEX_NAME]
    with contextlib.suppress(OSError):
        own += [p for p in Path(directory).iterdir() if _SLAB_NAME.match(p.name)]
    check_room(
        argument,
        HEADER_BYTES + capacity * (RECORD_BYTES + slot_bytes),
        directory=directory,
        held=held_bytes(own),
        fix=f"{fix}, or give a directory on a larger filesystem",
    )


class DiskPool(DiskFiles, BlockTier):
    """The local-SSD tier: ``capacity`` slots of ``layout.slot_bytes`` in slab files.

    Args:
      layout: the block format (the DRAM pools it exchanges blocks with must have the same).
      capacity: number of slots (blocks).
      directory: an existing, writable directory on a local filesystem, used by this pool
        alone. It is not created (:class:`tpusync.kv.DiskTier` creates it with ``create=True``);
        a missing one, a file, or one where no file can be made (a read-only mount,
        ``/proc``) raises :class:`~tpusync.errors.InvalidArgumentError` naming it.
      durability: ``"commit"`` syncs payloads before their records and the records before
        ``put`` returns (see the module docstring); ``"none"`` skips every fsync (faster;
        after a power loss only checksums stand between a reader and a torn block, and they
        do: a torn block is a miss).
      direct_io: ``"auto"`` uses O_DIRECT where the filesystem allows it (probed at open) and
        buffered I/O elsewhere; ``True`` insists on O_DIRECT; ``False`` always buffers. The
        choice is in :attr:`direct_io` and its reason in :attr:`direct_io_reason`.
      slab_slots: slots per slab file (default: slabs of about 1 GiB, at most 64 slabs).
      on_mismatch: what to do with an existing pool of another layout, geometry or format, or
        a damaged slab file: ``"recreate"`` (log and start cold / drop the slab's blocks) or
        ``"error"`` (raise :class:`~tpusync.errors.PoolFormatError`).
      io_threads: worker threads for block I/O (blocks in flight).

    Ownership: one process at a time (a ``flock`` the kernel releases when the owner dies,
    however it dies); a second one gets :class:`~tpusync.errors.PoolBusyError`.
    """

    def __init__(
        self,
        layout: PoolLayout,
        capacity: int,
        directory: str | os.PathLike[str],
        *,
        durability: str = "commit",
        direct_io: bool | str = "auto",
        slab_slots: int | None = None,
        on_mismatch: str = "recreate",
        io_threads: int = DEFAULT_IO_THREADS,
    ) -> None:
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        if not _is_int(capacity) or capacity < 1:
            raise InvalidArgumentError(
                f"capacity: expected a positive number of slots, got {capacity!r}"
            )
        if durability not in ("commit", "none"):
            raise InvalidArgumentError(
                f"durability: expected 'commit' or 'none', got {durability!r}"
            )
        if not (direct_io is True or direct_io is False or direct_io == "auto"):
            raise InvalidArgumentError(
                f"direct_io: expected 'auto', True or False, got {direct_io!r}"
            )
        if on_mismatch not in ("recreate", "error"):
            raise InvalidArgumentError(
                f"on_mismatch: expected 'recreate' or 'error', got {on_mismatch!r}"
            )
        if not _is_int(io_threads) or not 1 <= io_threads <= 256:
            raise InvalidArgumentError(f"io_threads: expected 1 to 256, got {io_threads!r}")
        if slab_slots is None:
            slab_slots = _default_slab_slots(layout.slot_bytes, capacity)
        elif not _is_int(slab_slots) or slab_slots < 1:
            raise InvalidArgumentError(
                f"slab_slots: expected a positive number of slots per slab, got {slab_slots!r}"
            )
        slab_slots = min(int(slab_slots), int(capacity))
        n_slabs = -(-capacity // slab_slots)
        if n_slabs > MAX_SLABS:
            raise InvalidArgumentError(
                f"slab_slots: {slab_slots} slots per slab make {n_slabs} slab files (at most "
                f"{MAX_SLABS}, each keeps a file open); use larger slabs"
            )
        try:
            directory = Path(os.fspath(directory))
        except TypeError:
            raise InvalidArgumentError(
                f"directory: expected a path, got {type(directory).__name__}"
            ) from None
        # missing, not a directory, or no file can be made there (a read-only mount, /proc):
        # refused here, naming it, not at the lock file's open
        check_writable_directory("directory", directory)
        # this uid's, not writable by others, and no symlink: its holder could repoint it
        # between this check and the opens of the pool's files, which go by the path
        check_directory(directory, argument="directory")
        check_disk_capacity("capacity", int(capacity), layout.slot_bytes)  # before any array

        self.layout = layout
        self.capacity = int(capacity)
        self.directory = directory
        self.durability = durability
        self.slab_slots = slab_slots
        self.n_slabs = n_slabs
        self.on_mismatch = on_mismatch
        self.io_threads = int(io_threads)
        self.index_path = directory / INDEX_NAME
        self.stats = TierStats(f"disk:{directory}")
        self.attached = False  # True when an existing pool was re-attached
        self.attach_seconds = 0.0
        self._lock = threading.Lock()
        self._closed = False
        self._in_flight = 0  # native block I/O calls running (close waits for them)
        self._idle = threading.Condition(self._lock)
        self._opened_by = os.getpid()
        self._lock_fd = -1
        self._index_fd = -1
        self._slab_fds: dict[int, int] = {}
        self._executor: ThreadPoolExecutor | None = None
        landing_run = _run_slots(layout.slot_bytes, LANDING_RUN_BYTES) * layout.slot_bytes
        self._staging = StagingBuffers(landing_run)  # get_scattered's, made on first use
        self._index: dict[bytes, int] = {}
        self._pins = np.zeros(self.capacity, dtype=np.int64)
        self._writing: set[bytes] = set()
        self._free: list[int] = []
        self._no_room_at: int | None = None  # filesystem bytes free when a slab did not fit
        self._sequence = 0
        self._pool_id = b""
        self._records = np.zeros(self.capacity, dtype=RECORD_DTYPE)

        self._take_lock()
        try:
            self.direct_io, self.direct_io_reason = choose_direct_io(directory, direct_io)
            log.info(
                "tpusync: disk pool %s: %s I/O (%s), durability=%s",
                directory,
                "direct (O_DIRECT)" if self.direct_io else "buffered",
                self.direct_io_reason,
                durability,
            )
            self._open_index()
            self._executor = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tpusync-disk")
        except BaseException:
            self._close_files()
            raise

    # --- opening ----------------------------------------------------------------------------------

    # --- queries ----------------------------------------------------------------------------------

    def __bool__(self) -> bool:
        return True  # a pool is a pool, open or closed (``len()`` of a closed one raises)

    def __len__(self) -> int:
        self._check_not_closed()  # a closed pool has no count to tell
        return len(self._index)

    @property
    def used(self) -> int:
        """Blocks stored (:class:`~tpusync.errors.PoolClosedError` once closed)."""
        self._check_not_closed()
        return len(self._index)

    @property
    def free(self) -> int:
        """Blocks that can still be stored now: free slots of the slab files made so far, plus
        the slots of those not made yet that fit on the filesystem (see :attr:`usable_capacity`)."""
        with self._lock:
            self._check_not_closed()
            return self.capacity - len(self._index) - len(self._writing) - self._unreachable()

    @property
    def usable_capacity(self) -> int:
        """The slots this pool can reach now: :attr:`capacity` less the slots of slab files not
        made yet that the filesystem has no room for (until space is freed there). A pool on a
        filesystem smaller than its capacity is full at this many blocks, and its owner evicts
        to reuse them (the KV store does)."""
        with self._lock:
            self._check_not_closed()
            return self.capacity - self._unreachable()

    def keys(self) -> list[bytes]:
        """Stored keys, oldest commit first."""
        with self._lock:
            self._check_not_closed()
            return list(self._index)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        self._check_open()
        with self._lock:
            return [k in self._index for k in keys]

    # --- the medium's part of put -----------------------------------------------------------------

    def put(self, keys: Sequence[bytes], source: SlotPool) -> int:
        """Stores the DRAM blocks under ``keys`` from ``source``; returns how many were written.

        Keys already stored (or being stored by another thread) and repeated keys are skipped.
        Raises, before anything is written: :class:`~tpusync.errors.BlocksMissingError` when
        ``source`` lacks some keys (its ``loaded`` mask is False exactly for those), and
        :class:`~tpusync.errors.TierFullError` when too few slots are free (the caller evicts
        with :meth:`delete`) or the filesystem has no room for a new slab. An I/O error while
        writing raises :class:`~tpusync.errors.TierFullError` (ENOSPC) or
        :class:`~tpusync.errors.TransferFailedError`; no block of that batch is committed and
        nothing stored before is touched. The source slots are pinned while they are read.
        """
        return self._put(keys, source, overwrite=False)

    @property
    def _what(self) -> str:
        return "disk pool"

    def _new_keys(self, keys: list[bytes], overwrite: bool) -> list[bytes]:
        with self._lock:
            return [k for k in keys if k not in self._index and k not in self._writing]

    def _store(
        self, keys: list[bytes], source: SlotPool, slots: np.ndarray, checksums: np.ndarray
    ) -> tuple[int, BaseException | None]:
        """Reserves slots (all or none: :class:`TierFullError`), writes the payloads and
        commits them; on an I/O error no block of the batch is committed."""
        picked, targets = self._reserve(keys)
        fresh = [keys[i] for i in picked]
        if not fresh:
            return 0, None
        try:
            self._write_payloads(source, slots[picked], targets)
            self._commit(fresh, targets, checksums[picked])
        except BaseException:
            self._release(fresh, targets)
            raise
        return len(fresh), None

    def _reserve(self, candidates: list[bytes]) -> tuple[list[int], list[int]]:
        """Takes a slot (creating slabs as needed) for every candidate key not stored by now,
        and marks it WRITING. Returns the positions in ``candidates`` taken and their slots."""
        with self._lock:
            self._check_open()
            picked = [
                i
                for i, k in enumerate(candidates)
                if k not in self._index and k not in self._writing
            ]
            keys = [candidates[i] for i in picked]
            unreachable = self._unreachable()
            available = self.capacity - len(self._index) - len(self._writing) - unreachable
            if len(keys) > available:
                raise TierFullError(
                    f"keys: {len(keys)} new blocks but {available} free slots of "
                    f"{self.capacity}{self._room_note(unreachable)}; delete or evict blocks first"
                )
            while len(self._free) < len(keys):
                missing = min(set(range(self.n_slabs)) - set(self._slab_fds))
                try:
                    self._create_slab(missing)
                except TierFullError:  # no room for it: count its slots out until space frees
                    self._no_room_at = self._filesystem_room()
                    raise
                self._no_room_at = None
            slots = [self._free.pop() for _ in keys]
            for key, slot in zip(keys, slots, strict=True):
                record = self._records[slot]
                record["state"] = WRITING  # first: a crash from here on leaves a torn slot
                record["key_len"] = len(key)
                record["key"] = key.ljust(MAX_KEY_BYTES, b"\0")
                record["checksum"] = 0
                record["length"] = 0
                record["sequence"] = 0
                self._writing.add(key)
            try:
                self._write_records(slots)
            except OSError as exc:
                self._release_locked(keys, slots)
                raise self._io_error(exc, "writing the index") from exc
        return picked, slots

    def _write_payloads(self, source: SlotPool, source_slots: np.ndarray, slots: list[int]) -> None:
        jobs = []
        for src, dst in zip(source_slots.tolist(), slots, strict=True):
            fd, offset = self._locate(dst)
            jobs.append((fd, src, offset))
        runs = _slab_runs(jobs, self.layout.slot_bytes)
        errors = self._transfer(source, jobs, runs, write=True)
        if errors:
            exc = next(iter(errors.values()))
            raise self._io_error(exc, f"writing {len(jobs)} blocks") from exc
        if self.durability == "commit":
            fds = sorted({fd for fd, _, _ in jobs})
            with self._io_running():  # close() waits for it before it closes the slabs
                sync_errors = self._run(os.fdatasync, fds, stop_on_error=False)
            if sync_errors:
                exc = next(iter(sync_errors.values()))
                raise self._io_error(exc, "syncing slab files") from exc

    def _transfer(
        self,
        pool: SlotPool,
        jobs: list[tuple[int, int, int]],
        runs: list[list[int]],
        *,
        write: bool,
    ) -> dict[int, OSError]:
        """Writes (or reads) the DRAM slots of ``jobs`` ((slab fd, DRAM slot, offset) each) to
        (from) the slabs, one ``pwritev`` (``preadv``) per run, all runs in one native call on
        the I/O threads with the GIL released; returns the OSErrors by run index. A write stops
        at its first error (the runs not started fail with ECANCELED)."""
        if not runs:
            return {}
        order = [i for run in runs for i in run]
        firsts = np.cumsum([0] + [len(run) for run in runs[:-1]])
        fds = [jobs[run[0]][0] for run in runs]
        offsets = [jobs[run[0]][2] for run in runs]
        # close() waits for this call before it closes the slab files
        with (
            self._io_running(),
            pool.slot_addresses(np.array([jobs[i][1] for i in order], np.int64)) as addresses,
        ):
            codes = _core.file_runs(
                np.array(fds, np.int32), np.array(offsets, np.int64),
                firsts.astype(np.int32), np.array([len(run) for run in runs], np.int32),
                addresses, np.full(len(order), self.layout.slot_bytes, np.uint64), write,
                self.io_threads, write,
            )  # fmt: skip
        return {
            r: OSError(int(code), os.strerror(int(code))) for r, code in enumerate(codes) if code
        }

    def _commit(self, keys: list[bytes], slots: list[int], checksums: np.ndarray) -> None:
        with self._lock:
            for slot, checksum in zip(slots, np.asarray(checksums).tolist(), strict=True):
                self._sequence += 1
                record = self._records[slot]
                record["checksum"] = checksum
                record["length"] = self.layout.payload_bytes
                record["sequence"] = self._sequence
                record["state"] = COMMITTED  # last: written with the rest of the record
            try:
                self._write_records(slots)
            except OSError as exc:
                raise self._io_error(exc, "writing the index") from exc
        try:
            self._sync_index()
        except OSError as exc:
            raise self._io_error(exc, "syncing the index") from exc
        with self._lock:
            for key, slot in zip(keys, slots, strict=True):
                self._index[key] = slot
                self._writing.discard(key)

    def _release(self, keys: list[bytes], slots: list[int]) -> None:
        with self._lock:
            self._release_locked(keys, slots)

    def _release_locked(self, keys: list[bytes], slots: list[int]) -> None:
        """Frees reserved slots of a failed put (their records back to FREE)."""
        for key, slot in zip(keys, slots, strict=True):
            if self._index.get(key) == slot:
                del self._index[key]
            self._records[slot]["state"] = FREE
            self._writing.discard(key)
        self._free.extend(reversed(slots))
        if self._index_fd >= 0:
            with contextlib.suppress(OSError):  # a WRITING record left behind is freed on open
                self._write_records(slots)

    # --- room on the filesystem -------------------------------------------------------------------

    def _filesystem_room(self) -> int:
        """Bytes the filesystem of the pool's directory can still give (0 if it cannot say;
        unbounded for one that reports no size, e.g. ramfs)."""
        try:
            st = os.statvfs(self.directory)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize if st.f_blocks else sys.maxsize

    def _unreachable(self) -> int:
        """Slots of the slab files not made yet that the filesystem has no room for: none until
        a slab failed for want of space; then all of them while the filesystem has no more room
        than then, and afterwards the slabs from the first that does not fit (slabs are made
        lowest first). Call with ``_lock`` held."""
        if self._no_room_at is None:
            return 0
        missing = [slab for slab in range(self.n_slabs) if slab not in self._slab_fds]
        room = self._filesystem_room()
        if room <= self._no_room_at:
            room = 0
        for n, slab in enumerate(missing):
            size = self._slab_file_bytes(slab)
            if size > room:
                return sum(hi - lo for lo, hi in map(self._slab_range, missing[n:]))
            room -= size
        return 0

    def _room_note(self, unreachable: int) -> str:
        """Why ``unreachable`` slots cannot be had, for an error message ('' when none)."""
        if not unreachable:
            return ""
        return (
            f" ({unreachable} of them are in slab files the filesystem of {self.directory} has "
            f"no room for: {_mib(self._filesystem_room())} free, slabs of "
            f"{_mib(self._slab_file_bytes(0))})"
        )

    # --- the medium's part of get -----------------------------------------------------------------

    @contextlib.contextmanager
    def _reading(self, keys: list[bytes]) -> Iterator[list[bytes]]:
        """Pins the slots of the stored ``keys`` (:meth:`delete` skips them) while they are read."""
        with self._lock:
            present = [k for k in keys if k in self._index]
            pinned = np.array([self._index[k] for k in present], dtype=np.int64)
            np.add.at(self._pins, pinned, 1)
        try:
            yield present
        finally:
            with self._lock:
                np.add.at(self._pins, pinned, -1)

    def _load(self, reservation: Reservation, target: SlotPool) -> list[Load]:
        with self._lock:  # pinned: neither slot nor record changes until the read is done
            slots = [self._index[k] for k in reservation.keys]
            stored = self._records["checksum"][slots].tolist()
        jobs = []
        for slot, dst in zip(slots, reservation.slots.tolist(), strict=True):
            fd, offset = self._locate(slot)
            jobs.append((fd, dst, offset))
        runs = _slab_runs(jobs, self.layout.slot_bytes)
        failed = _errors_by_block(  # job index -> error
            runs, lambda some: self._transfer(target, jobs, some, write=False)
        )
        return [
            Load(LoadStatus.ERROR, error=failed[i], reason=str(failed[i]))
            if i in failed
            else Load(LoadStatus.OK, checksum=int(stored[i]))
            for i in range(len(jobs))
        ]

    def get_scattered(self, keys: Sequence[bytes], scatter: Scatter) -> list[bool]:
        """Reads the blocks under ``keys`` (distinct) straight into the places ``scatter`` gives
        them (an engine's tensors), each checked against its recorded checksum over the bytes
        that landed (:mod:`tpusync._src.tiers.disk._landing`); returns which are loaded. A block
        that is absent, fails its checksum (counted, and deleted) or cannot be read (deleted)
        is a miss, and its places may hold anything. Nothing is kept in DRAM."""
        keys = check_keys(keys)
        self._check_open()
        if len(set(keys)) != len(keys):
            raise InvalidArgumentError("keys: repeated keys; pass each key once")
        scatter = scatter.checked(len(keys), self.layout.payload_bytes)
        index = {k: i for i, k in enumerate(keys)}
        loads: dict[bytes, Load] = {}
        with self._reading(keys) as present:
            with self._lock:
                slots = [self._index[k] for k in present]
                stored = self._records["checksum"][slots]
            blocks = [index[k] for k in present]
            places = [self._locate(slot) for slot in slots]
            jobs = [(fd, i, offset) for i, (fd, offset) in enumerate(places)]
            segments = segments_of(scatter.select(blocks), self.layout, len(blocks))
            landed = np.zeros(len(blocks), dtype=np.uint64)  # each block's checksum as landed
            land = lander(places, segments, self.layout.slot_bytes, self._staging, landed)
            with self._io_running():
                errors = _errors_by_block(
                    _slab_runs(jobs, self.layout.slot_bytes, LANDING_RUN_BYTES),
                    lambda some: self._run(land, some, stop_on_error=False),
                )
        for i, key in enumerate(present):
            if i in errors:
                loads[key] = Load(LoadStatus.ERROR, error=errors[i], reason=str(errors[i]))
            elif landed[i] != stored[i]:
                loads[key] = Load(LoadStatus.CORRUPT, reason="payload checksum mismatch")
            else:
                loads[key] = Load(LoadStatus.OK, checksum=int(stored[i]))
        failed = [(k, x) for k, x in loads.items() if x.status != LoadStatus.OK]
        if failed:
            self._discard(failed)
        loaded = [k in loads and loads[k].status == LoadStatus.OK for k in keys]
        hits = sum(loaded)
        self.stats.add(
            hits=hits,
            misses=len(keys) - hits,
            checksum_failures=sum(x.status == LoadStatus.CORRUPT for _, x in failed),
            bytes_out=hits * self.layout.payload_bytes,
        )
        return loaded

    @contextlib.contextmanager
    def _io_running(self) -> Iterator[None]:
        """Counts block I/O in flight: :meth:`close` waits for it before closing the files."""
        with self._lock:
            self._check_not_closed()
            self._in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._idle.notify_all()

    def _discard(self, failed: list[tuple[bytes, Load]]) -> None:
        """Drops blocks that failed their checksum or could not be read (logged)."""
        corrupt = [k for k, x in failed if x.status == LoadStatus.CORRUPT]
        unreadable = [x for _, x in failed if x.status == LoadStatus.ERROR]
        if corrupt:
            log.warning(
                "tpusync: disk pool %s: %d blocks failed their checksum; dropped",
                self.directory,
                len(corrupt),
            )
        if unreadable:
            first = unreadable[0].error
            log.warning(
                "tpusync: disk pool %s: %d blocks could not be read (%s); dropped",
                self.directory,
                len(unreadable),
                (first.strerror if first is not None else None) or first,
            )
        self.delete([k for k, _ in failed])

    # --- delete, flush, close ---------------------------------------------------------------------

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drops the blocks under ``keys``; blocks being read (pinned) and absent keys are
        skipped. Returns how many were dropped. (Not synced: see the module docstring.)"""
        keys = check_keys(keys)
        self._check_open()
        dropped = []
        with self._lock:
            for key in keys:
                slot = self._index.get(key)
                if slot is None or self._pins[slot]:
                    continue
                del self._index[key]
                self._records[slot]["state"] = FREE
                self._free.append(slot)
                dropped.append(slot)
            if dropped:
                try:
                    self._write_records(dropped)
                except OSError as exc:  # the blocks are gone from the index in memory anyway
                    log.warning("tpusync: disk pool %s: %s", self.directory, exc)
        self.stats.add(deletes=len(dropped))
        return len(dropped)

    def flush(self) -> None:
        """Syncs every slab file and the index (what ``durability="none"`` skips)."""
        self._check_open()
        with self._lock:
            fds = [*self._slab_fds.values(), self._index_fd]
        try:
            for fd in fds:
                os.fdatasync(fd)
        except OSError as exc:
            raise self._io_error(exc, "syncing") from exc

    def close(self) -> None:
        """Waits for I/O in flight, closes the files and releases ownership. The pool stays in
        its directory for the next process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while self._in_flight:  # native block I/O still uses the slab files
                self._idle.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._staging.close()
        self._close_files()

    def _close_files(self) -> None:
        for fd in self._slab_fds.values():
            os.close(fd)
        self._slab_fds.clear()
        if self._index_fd >= 0:
            os.close(self._index_fd)
            self._index_fd = -1
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = -1

    def __enter__(self) -> DiskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"DiskPool({self.directory}, closed)"
        mode = "direct" if getattr(self, "direct_io", False) else "buffered"
        return (
            f"DiskPool({self.directory}, {self.used}/{self.capacity} slots of "
            f"{self.layout.slot_bytes} B, {mode} I/O, durability={self.durability})"
        )

    # --- helpers ----------------------------------------------------------------------------------

    def _check_not_closed(self) -> None:
        if self._closed:
            raise PoolClosedError(
                f"the disk pool in {self.directory} is closed; open a new DiskPool there"
            )

    def _check_open(self) -> None:
        self._check_not_closed()
        check_same_process(self._opened_by, f"the disk pool in {self.directory}")

    def _run(
        self, fn: Callable[[Any], None], jobs: Sequence[Any], *, stop_on_error: bool
    ) -> dict[int, OSError]:
        """Runs ``fn`` on every job on the I/O threads (:func:`run_jobs`)."""
        return run_jobs(self._executor, self.io_threads, fn, jobs, stop_on_error=stop_on_error)


MAX_RUN_BYTES = 4 << 20  # one preadv/pwritev covers at most this much of consecutive slots
_MAX_RUN_SLOTS = 64  # and at most this many slots (iovecs)
# get_scattered's reads: smaller, so that a run is copied out while the others still read
# (docs/decisions/0005-tier-io.md)
LANDING_RUN_BYTES = 2 << 20


def _run_slots(slot_bytes: int, run_bytes: int) -> int:
    """How many consecutive slots one read or write covers (at least one)."""
    return max(1, min(_MAX_RUN_SLOTS, run_bytes // slot_bytes))


def _errors_by_block(
    runs: list[list[int]], read: Callable[[list[list[int]]], dict[int, OSError]]
) -> dict[int, OSError]:
    """Reads ``runs`` (``read`` answers the OSErrors by run index) and returns the OSErrors by
    block: a failed run of several blocks is read again block by block, so one bad slot does
    not take its neighbours down."""
    errors = read(runs)
    alone = [i for r in errors for i in runs[r]]
    if alone and any(len(runs[r]) > 1 for r in errors):
        return {alone[r]: exc for r, exc in read([[i] for i in alone]).items()}
    return {i: exc for r, exc in errors.items() for i in runs[r]}


def _slab_runs(
    jobs: list[tuple[int, int, int]], slot_bytes: int, run_bytes: int = MAX_RUN_BYTES
) -> list[list[int]]:
    """Indices of ``jobs`` ((slab fd, DRAM slot, offset) each) grouped into runs of slots that
    follow each other in one slab file, one ``preadv``/``pwritev`` each: a prefix saved together
    lies in consecutive slots, and small direct I/O requests are latency-bound (decision
    0005)."""
    limit = _run_slots(slot_bytes, run_bytes)
    runs: list[list[int]] = []
    for i in sorted(range(len(jobs)), key=lambda i: (jobs[i][0], jobs[i][2])):
        if runs:
            last = jobs[runs[-1][-1]]
            fd, offset = jobs[i][0], jobs[i][2]
            if fd == last[0] and offset == last[2] + slot_bytes and len(runs[-1]) < limit:
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs
