"""Opening a disk pool's files: its lock, its index (re-attached or made cold), its slab files
(checked, created when first needed) and its records (see :mod:`tpusync._src.tiers.disk.pool`)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from tpusync._src.tiers._file_writes import file_error
from tpusync._src.tiers._files import open_file
from tpusync._src.tiers.blocks import MAX_KEY_BYTES
from tpusync._src.tiers.disk.file_format import (
    _CRC,
    _NO_SPACE,
    _SLAB_FIXED,
    _SLAB_NAME,
    _TEMP_NAME,
    FORMAT_VERSION,
    HEADER_BYTES,
    INDEX_NAME,
    LOCK_NAME,
    MAX_SEQUENCE,
    RECORD_BYTES,
    SLAB_MAGIC,
    _create_file,
    _decode_index_header,
    _encode_index_header,
    _is_directory,
    _mib,
    _remove_file,
    _runs,
)
from tpusync._src.tiers.dram import COMMITTED, FREE, RECORD_DTYPE, WRITING
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import (
    PoolBusyError,
    PoolFormatError,
    TierFullError,
    TpuSyncError,
    TransferFailedError,
    UnsafeFileError,
)

log = logging.getLogger("tpusync.tiers")


class DiskFiles:
    """The file side of :class:`~tpusync.tiers.DiskPool` (a base it builds on): opening,
    geometry and records. Call the methods that touch shared state with ``_lock`` held, as
    the pool does."""

    layout: PoolLayout
    capacity: int
    directory: Path
    durability: str
    slab_slots: int
    n_slabs: int
    on_mismatch: str
    index_path: Path
    stats: TierStats
    direct_io: bool
    attached: bool
    attach_seconds: float
    _lock: threading.Lock
    _lock_fd: int
    _index_fd: int
    _slab_fds: dict[int, int]
    _index: dict[bytes, int]
    _free: list[int]
    _sequence: int
    _pool_id: bytes
    _records: np.ndarray

    def _take_lock(self) -> None:
        path = self.directory / LOCK_NAME
        try:
            fd = open_file(path, os.O_RDWR, create=True)  # UnsafeFileError: names the path
        except UnsafeFileError:
            raise
        except OSError as exc:
            raise file_error(exc, path, "opening the disk pool's lock file") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise PoolBusyError(
                f"directory: the disk pool in {self.directory} is owned by a live process "
                f"(pid {pid}); use another directory, or stop that process first"
            ) from None
        with contextlib.suppress(OSError):  # the pid is informational (a full disk is fine)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _open_index(self) -> None:
        start = time.perf_counter()
        try:
            fd = open_file(self.index_path, os.O_RDWR)
        except FileNotFoundError:
            self._cold_start(reason=None)
            return
        except UnsafeFileError as exc:  # damage of another kind: treated as a damaged index
            if self.on_mismatch == "error" or _is_directory(self.index_path):
                raise
            self._cold_start(reason=str(exc))
            return
        except OSError as exc:
            raise file_error(exc, self.index_path, "opening the index") from exc
        try:
            self._attach(fd)
        except PoolFormatError as exc:
            os.close(fd)
            self._index_fd = -1
            for slab_fd in self._slab_fds.values():
                os.close(slab_fd)
            self._slab_fds.clear()
            if self.on_mismatch == "error":
                raise PoolFormatError(f"disk pool {self.directory}: {exc}") from None
            self._cold_start(reason=str(exc))
            return
        except BaseException as exc:
            os.close(fd)
            self._index_fd = -1
            if isinstance(exc, OSError) and not isinstance(exc, TpuSyncError):
                raise file_error(exc, self.index_path, "reading the index") from exc
            raise
        self.attached = True
        self.attach_seconds = time.perf_counter() - start

    def _attach(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        header = os.pread(fd, HEADER_BYTES, 0)
        pool_id, fingerprint, capacity, slab_slots, slot_bytes, description = _decode_index_header(
            header, size
        )
        if (
            fingerprint != self.layout.fingerprint
            or capacity != self.capacity
            or slab_slots != self.slab_slots
            or slot_bytes != self.layout.slot_bytes
        ):
            raise PoolFormatError(
                f"it holds another layout or geometry ({capacity} slots of {slot_bytes} B in "
                f"slabs of {slab_slots}, model {description.get('model_id')!r})"
            )
        need = HEADER_BYTES + self.capacity * RECORD_BYTES
        if size < need:
            raise PoolFormatError(f"truncated: {size} bytes, the header describes {need}")
        raw = os.pread(fd, self.capacity * RECORD_BYTES, HEADER_BYTES)
        if len(raw) != self.capacity * RECORD_BYTES:
            raise PoolFormatError("truncated records")
        self._index_fd = fd
        self._pool_id = pool_id
        self._records = np.frombuffer(raw, dtype=RECORD_DTYPE).copy()
        self._scan()

    def _scan(self) -> None:
        """Builds the index from the records and checks the slab files: O(slots + slabs)."""
        records = self._records
        states = records["state"]
        changed = False

        torn = np.flatnonzero(states == WRITING)
        if len(torn):
            states[torn] = FREE
            self.stats.add(torn_discarded=len(torn))
            changed = True
            log.info("tpusync: %s: dropped %d blocks torn by a crash", self.directory, len(torn))
        key_len = records["key_len"].astype(np.int64)
        invalid = (states != FREE) & (
            (states != COMMITTED)
            | (key_len < 1)
            | (key_len > MAX_KEY_BYTES)
            | (records["length"] != self.layout.payload_bytes)
            | (records["sequence"] > MAX_SEQUENCE)  # a later commit's sequence must still fit
        )
        if invalid.any():
            log.warning(
                "tpusync: %s: dropped %d index records that make no sense",
                self.directory,
                int(invalid.sum()),
            )
            states[invalid] = FREE
            changed = True

        self._clean_directory()
        for slab in range(self.n_slabs):
            lo, hi = self._slab_range(slab)
            has_blocks = bool((states[lo:hi] == COMMITTED).any())
            problem = self._open_slab(slab)
            if problem is None or (problem == "missing" and not has_blocks):
                continue
            message = f"slab file {self._slab_path(slab).name} is {problem}"
            if self.on_mismatch == "error":
                raise PoolFormatError(message)  # the caller closes what is open
            if has_blocks:
                dropped = int((states[lo:hi] == COMMITTED).sum())
                states[lo:hi][states[lo:hi] == COMMITTED] = FREE
                changed = True
                log.warning(
                    "tpusync: %s: %s; its %d blocks are dropped", self.directory, message, dropped
                )
            self._slab_path(slab).unlink(missing_ok=True)

        committed = np.flatnonzero(states == COMMITTED)
        if len(committed):
            sequences = records["sequence"][committed]
            self._sequence = int(sequences.max())
            order = committed[np.argsort(sequences, kind="stable")]
            raw_keys = records["key"]
            for slot in order.tolist():
                key = bytes(raw_keys[slot])[: int(key_len[slot])]
                older = self._index.get(key)
                if older is not None:  # a stale copy (e.g. a deletion lost to a power cut)
                    states[older] = FREE
                    changed = True
                self._index[key] = slot
        if changed:
            try:
                self._write_all_records()
                self._sync_index()
            except OSError as exc:
                raise file_error(exc, self.index_path, "rewriting the index records") from exc
        used = np.zeros(self.capacity, dtype=bool)
        used[list(self._index.values())] = True
        free = []
        for slab in sorted(self._slab_fds, reverse=True):
            lo, hi = self._slab_range(slab)
            free.extend(s for s in range(hi - 1, lo - 1, -1) if not used[s])
        self._free = free

    def _cold_start(self, reason: str | None) -> None:
        if reason is not None:
            log.warning(
                "tpusync: disk pool %s: %s; starting a cold pool in its place",
                self.index_path,
                reason,
            )
        for path in self.directory.iterdir():
            if _SLAB_NAME.match(path.name) or _TEMP_NAME.match(path.name):
                _remove_file(path)
        self._pool_id = os.urandom(16)
        header = _encode_index_header(self._pool_id, self.layout, self.capacity, self.slab_slots)
        size = HEADER_BYTES + self.capacity * RECORD_BYTES
        temp = self.directory / f".{INDEX_NAME}.tmp-{os.getpid()}"
        try:
            fd = _create_file(temp)
        except OSError as exc:
            if isinstance(exc, TpuSyncError):
                raise
            raise file_error(exc, self.index_path, "creating the index") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, size)  # zeros: every record FREE
            except OSError as exc:
                what = f"preallocating the index ({_mib(size)})"
                raise file_error(exc, self.index_path, what) from exc
            try:
                os.pwrite(fd, header, 0)
                if self.durability == "commit":
                    os.fsync(fd)
                os.rename(temp, self.index_path)
            except OSError as exc:
                raise file_error(exc, self.index_path, "writing a new index") from exc
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        self._index_fd = fd
        try:
            self._sync_directory()
        except OSError as exc:
            raise file_error(exc, self.directory, "syncing the directory") from exc
        self._records = np.zeros(self.capacity, dtype=RECORD_DTYPE)
        self._free = []

    def _clean_directory(self) -> None:
        """Removes temporary files of interrupted slab creations and slabs out of range."""
        for path in self.directory.iterdir():
            match = _SLAB_NAME.match(path.name)
            if _TEMP_NAME.match(path.name) or (match and int(match.group(1)) >= self.n_slabs):
                _remove_file(path)

    def _open_slab(self, slab: int) -> str | None:
        """Opens slab ``slab`` if its file exists and is ours; else says what is wrong."""
        path = self._slab_path(slab)
        try:
            fd = open_file(path, os.O_RDONLY)
        except FileNotFoundError:
            return "missing"
        except UnsafeFileError as exc:  # damage of another kind; "error" says so as it is
            if self.on_mismatch == "error" or _is_directory(path):
                raise
            return f"unusable ({exc})"
        except OSError as exc:
            return f"unreadable ({exc.strerror or exc})"
        try:
            header = os.pread(fd, HEADER_BYTES, 0)
            info = os.fstat(fd)
        except OSError as exc:
            return f"unreadable ({exc.strerror or exc})"
        finally:
            os.close(fd)
        size = info.st_size
        expected = self._slab_header(slab)
        if size < len(expected) or header[: _SLAB_FIXED.size] != expected[: _SLAB_FIXED.size]:
            return "not a slab of this pool (bad header)"
        if header[: len(expected)] != expected:
            return "damaged (header checksum)"
        if size != self._slab_file_bytes(slab):
            return f"truncated ({size} bytes of {self._slab_file_bytes(slab)})"
        try:
            fd = self._open_slab_fd(path)
        except OSError as exc:
            return f"unusable ({exc.strerror or exc})"
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
            os.close(fd)
            return "replaced while it was opened"
        self._slab_fds[slab] = fd
        return None

    def _open_slab_fd(self, path: Path) -> int:
        flags = os.O_RDWR | (os.O_DIRECT if self.direct_io else 0)
        return open_file(path, flags)

    def _create_slab(self, slab: int) -> None:
        """Creates and preallocates slab ``slab`` (temporary name, then rename)."""
        path = self._slab_path(slab)
        size = self._slab_file_bytes(slab)
        temp = self.directory / f".{path.name}.tmp-{os.getpid()}"
        try:
            fd = _create_file(temp)
        except OSError as exc:  # TierFullError is no OSError: it passes as it is
            if isinstance(exc, TpuSyncError):
                raise
            raise self._io_error(exc, f"creating slab file {path}") from exc
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise self._io_error(exc, f"preallocating slab {slab} ({_mib(size)})") from None
            try:
                os.pwrite(fd, self._slab_header(slab), 0)
                if self.durability == "commit":
                    os.fsync(fd)
                os.rename(temp, path)
            except OSError as exc:
                raise self._io_error(exc, f"writing slab file {path}") from exc
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            self._sync_directory()
            slab_fd = self._open_slab_fd(path)
        except OSError as exc:
            if isinstance(exc, TpuSyncError):
                raise
            raise self._io_error(exc, f"opening slab file {path}") from exc
        self._slab_fds[slab] = slab_fd
        lo, hi = self._slab_range(slab)
        self._free.extend(range(lo, hi))
        self._free.sort(reverse=True)  # lowest slots first: fill slabs in order

    def _io_error(self, exc: OSError, what: str) -> Exception:
        """The error for a failed ``what`` (a gerund phrase): TierFullError when the
        filesystem is full, TransferFailedError otherwise."""
        if exc.errno in _NO_SPACE:
            st = os.statvfs(self.directory)
            return TierFullError(
                f"capacity: {what} in {self.directory} failed: {exc.strerror}; the filesystem "
                f"has {_mib(st.f_bavail * st.f_frsize)} free of "
                f"{_mib(st.f_blocks * st.f_frsize)}; delete blocks, free space or lower the "
                "capacity"
            )
        return TransferFailedError(
            f"{self.directory}: {what} failed: {exc.strerror or exc}; no block of this call "
            "was committed"
        )

    # --- geometry ---------------------------------------------------------------------------------

    def _slab_path(self, slab: int) -> Path:
        return self.directory / f"slab-{slab:06d}.tpd"

    def _slab_range(self, slab: int) -> tuple[int, int]:
        lo = slab * self.slab_slots
        return lo, min(lo + self.slab_slots, self.capacity)

    def _slab_file_bytes(self, slab: int) -> int:
        lo, hi = self._slab_range(slab)
        return HEADER_BYTES + (hi - lo) * self.layout.slot_bytes

    def _slab_header(self, slab: int) -> bytes:
        lo, hi = self._slab_range(slab)
        fixed = _SLAB_FIXED.pack(
            SLAB_MAGIC,
            FORMAT_VERSION,
            HEADER_BYTES,
            slab,
            hi - lo,
            self.layout.slot_bytes,
            self._pool_id,
            self.layout.fingerprint,
        )
        return fixed + _CRC.pack(zlib.crc32(fixed))

    def _locate(self, slot: int) -> tuple[int, int]:
        """The slab file descriptor and byte offset of slot ``slot``."""
        slab, within = divmod(int(slot), self.slab_slots)
        return self._slab_fds[slab], HEADER_BYTES + within * self.layout.slot_bytes

    # --- records ----------------------------------------------------------------------------------

    def _write_records(self, slots: Sequence[int]) -> None:
        """Writes the in-memory records of ``slots`` to the index, runs of slots at once."""
        for lo, hi in _runs(sorted(slots)):
            os.pwrite(
                self._index_fd,
                self._records[lo:hi].tobytes(),
                HEADER_BYTES + lo * RECORD_BYTES,
            )

    def _write_all_records(self) -> None:
        os.pwrite(self._index_fd, self._records.tobytes(), HEADER_BYTES)

    def _sync_index(self) -> None:
        if self.durability == "commit":
            os.fdatasync(self._index_fd)

    def _sync_directory(self) -> None:
        if self.durability != "commit":
            return
        fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
