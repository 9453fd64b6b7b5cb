"""SharedFsPool: the shared-filesystem tier — one content-addressed file per block in a directory
that many hosts share (Lustre, NFS, GCS-fuse, or a local disk).

Where blocks live::

    <directory>/<fingerprint hex>/layout.json           what the blocks below are (informational)
    <directory>/<fingerprint hex>/<kk>/<key hex>.blk    one block; kk = the key's first byte, in hex

The fingerprint level keeps models and layouts apart: a pool only ever looks under its own
layout's fingerprint, so blocks of another model are never even opened.

Block file format, version 1 (little-endian)::

    [header: 4096 bytes][payload: layout.payload_bytes, the slot's bytes as DRAM holds them]

    header = magic "TPUSYNCB" | format version u32 | header bytes u32 (4096) | key length u16 |
             checksum scheme u16 | reserved u32 | key (32 bytes, zero padded) |
             layout fingerprint (16 bytes) | payload length u64 | payload checksum u64 |
             written at (ns since the epoch) u64 | writer ("host:pid", 64 bytes, informational) |
             header checksum u64 (XXH64 of the 160 bytes before it) |
             MAC section, only when written with a MAC key: "MAC1" | nonce (16 bytes) |
             Poly1305 tag (16 bytes), see :mod:`tpusync._src.tiers.mac` | zeros up to 4096

The payload starts on a page boundary of the file. The payload checksum is the DRAM tier's block
checksum (:meth:`HostPool.hash_slots`); the checksum scheme field names it (it is the DRAM pool's
scheme, :data:`tpusync._src.tiers.blocks.CHECKSUM_SCHEME`), so a build with another scheme
sees such files as foreign misses rather than corrupt ones.

Publish protocol (what makes a partial block invisible on every host):

1. The writer creates ``.<key hex>.tmp-<host>-<pid>-<random>`` with ``O_EXCL`` (mode 0600) in
   the block's own directory (unique per host, process and call; readers never open a dot name).
2. It writes header and payload with one ``pwritev`` straight from the DRAM slot (no copy), then,
   when ``durability="commit"``, ``fsync``s the file.
3. ``close``, then ``rename`` to ``<key hex>.blk``: atomic on POSIX filesystems (and on NFS,
   Lustre; GCS-fuse publishes the object whole). A reader opens either the old file, the new one,
   or none — never a partial one. Two writers of one key write the same content; the last rename
   wins and both files are whole.
4. With ``durability="commit"`` the directory is ``fsync``\\ed after the batch's renames (and a
   new ``<kk>`` directory's parent after it is created), so that after a power loss every name
   that survives refers to synced bytes. ``durability="none"`` skips every fsync: still atomic
   for live readers and after a process crash, but after a power loss a file may come back short or
   zero-filled — which readers then detect (length, checksums) and treat as a miss.

Readers: ``get`` reserves DRAM slots, reads header and payload with one ``preadv`` straight into the
slot memory, checks magic, version, header checksum, key, fingerprint and length, then hashes the
bytes read (:meth:`HostPool.hash_slots`, over the slot memory: slots are reused, so the checksum is
always of the bytes actually read) and compares with the header. Matching blocks are committed to
the DRAM pool, the rest aborted. A corrupt file (truncated, garbage, another key or fingerprint, a
checksum mismatch) is a miss, counted in ``stats.checksum_failures``, and is unlinked — unless the
name has meanwhile been republished by a writer (the inode is compared first; the remaining window
can only cost a miss, never serve a wrong byte). A file of another format version or checksum scheme
is a miss left in place (a newer host may be using it). I/O errors while reading are misses too.

Trust: files are opened through :mod:`tpusync._src.tiers._files` (no symlink followed, no blocking
open of a FIFO, an ``fstat`` check): anything but a regular file of this uid that others cannot
write at a block's path is a corrupt miss like the above (removed, unless it is a directory).
The directory given, the layout's directory and its fan-out directories must belong to this uid,
not be writable by group or others (hosts that share the tier run as one uid), and not be
symlinks (give the directory a link points to): anything
else is an :class:`~tpusync.errors.UnsafeFileError` saying how to fix it. Directories are
created 0700.

Crashed writers leave ``.tmp-`` files that nothing reads; :meth:`SharedFsPool.sweep` removes the
ones older than a given age (choose it well above the longest write plus any clock skew between
hosts and the file server).

Ownership: ``put`` pins the source slots while it reads them and unpins them before returning
(whatever happens); ``get`` owns the slots it reserves until it commits or aborts them, and waits
for every read before either, so a reused slot is never written by a late read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import numbers
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np

from tpusync._src.memory.fork_guard import check_same_process
from tpusync._src.tiers._file_writes import write_file_atomically
from tpusync._src.tiers._files import DIRECTORY_MODE, check_directory, open_file
from tpusync._src.tiers._keys import check_keys
from tpusync._src.tiers.base import BlockTier, Load, LoadStatus, SlotPool, is_slot_pool, readable
from tpusync._src.tiers.blocks import MAX_KEY_BYTES
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.mac import MAC_BYTES, MacKey
from tpusync._src.tiers.shared_fs.file_format import (
    _FANOUT,
    _FAST_STAT_S,
    _HOST,
    _STAT_PROBE,
    DURABILITY,
    HEADER_BYTES,
    HEADER_USED,
    SUFFIX,
    TEMP_MARK,
    _Corrupt,
    _Foreign,
    decode_block_header,
    encode_block_header,
)
from tpusync._src.tiers.slots import Reservation
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import (
    InvalidArgumentError,
    PoolClosedError,
    TierFullError,
    TpuSyncError,
    TransferFailedError,
    UnsafeFileError,
)

__all__ = ["HEADER_BYTES", "SharedFsPool"]

log = logging.getLogger("tpusync.tiers")


class SharedFsPool(BlockTier):
    """Blocks of one layout as content-addressed files in a shared directory.

    Args:
      layout: the block format (the DRAM pools it exchanges blocks with must have the same one).
      directory: an existing directory, typically on a filesystem shared by many hosts. It is
        not created (a missing mount point must not silently become a local directory); the
        layout's subdirectory in it is.
      capacity: a soft limit on the number of blocks of this layout, checked by :meth:`put`
        before it writes (a directory scan; approximate while other hosts write). None for
        unbounded: :attr:`capacity` then reports ``sys.maxsize`` and the filesystem's free space
        is the limit (a full filesystem makes ``put`` raise :class:`TierFullError`).
      durability: ``"commit"`` fsyncs every file before its rename and every directory after it;
        ``"none"`` skips fsync (see the module docstring for what each guarantees).
      io_threads: threads that read and write files concurrently (shared filesystems are
        latency-bound: several requests in flight multiply throughput). 1 runs on the caller.
      mac_key: authenticate every block file with a keyed MAC (:mod:`tpusync._src.tiers.mac`):
        files are written with a tag, and a file whose tag does not verify (forged, damaged,
        or written without this key) is a corrupt miss. For filesystems where writers outside
        this deployment can reach the files (see the README's security section).
    """

    def __init__(
        self,
        layout: PoolLayout,
        directory: str | os.PathLike[str],
        *,
        capacity: int | None = None,
        durability: str = "commit",
        io_threads: int = 8,
        mac_key: MacKey | None = None,
    ) -> None:
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        if not isinstance(directory, str | os.PathLike):
            raise InvalidArgumentError(
                f"directory: expected a path, got {type(directory).__name__}"
            )
        if capacity is not None and (
            not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or capacity < 1
        ):
            raise InvalidArgumentError(
                f"capacity: expected None or a positive number of blocks, got {capacity!r}"
            )
        if durability not in DURABILITY:
            raise InvalidArgumentError(
                f"durability: expected 'commit' or 'none', got {durability!r}"
            )
        if (
            not isinstance(io_threads, numbers.Integral)
            or isinstance(io_threads, bool)
            or io_threads < 1
        ):
            raise InvalidArgumentError(
                f"io_threads: expected a positive number of threads, got {io_threads!r}"
            )
        if mac_key is not None and not isinstance(mac_key, MacKey):
            raise InvalidArgumentError(
                "mac_key: expected None or a tpusync._src.tiers.mac.MacKey "
                f"(mac_key_from_secret(secret)), got {type(mac_key).__name__}"
            )
        path = os.path.abspath(os.fspath(directory))
        if not os.path.isdir(path):
            what = "is not a directory" if os.path.exists(path) else "does not exist"
            raise InvalidArgumentError(
                f"directory: {path} {what}; create it (or mount the shared filesystem) first"
            )
        # checked where it is, never through a symlink: blocks are opened by path, so a link's
        # holder could repoint it after this check
        _check_shared_directory(path, "directory")
        self.layout = layout
        self.directory = path
        self.durability = durability
        self.io_threads = int(io_threads)
        self.mac = mac_key is not None
        self._mac_key = mac_key
        self.stats = TierStats(f"sharedfs:{path}")
        self._capacity = None if capacity is None else int(capacity)
        self._root = os.path.join(path, layout.fingerprint.hex())
        self._known_dirs: set[str] = set()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False
        self._opened_by = os.getpid()
        self._prepare_root()

    # --- the LowerTier interface -------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """The block limit given, or ``sys.maxsize`` when unbounded."""
        return sys.maxsize if self._capacity is None else self._capacity

    @property
    def used(self) -> int:
        """Blocks of this layout in the directory (a directory scan)."""
        return len(self.keys())

    verify_source = True  # other hosts read these files without our index

    def put(self, keys: Sequence[bytes], source: SlotPool, *, overwrite: bool = False) -> int:
        """Stores the blocks under ``keys`` from ``source``; returns how many files were written.

        Keys already stored are skipped unless ``overwrite`` (which rewrites them, e.g. to repair
        a damaged file; readers see the old file or the new one). Raises
        :class:`BlocksMissingError` before writing anything when a key is absent from ``source``
        or its DRAM block fails its checksum (that block is dropped from ``source``);
        :class:`TierFullError` before writing anything when ``capacity`` would be exceeded, or
        when the filesystem is full; :class:`TransferFailedError` on other I/O errors. Blocks
        written before an I/O error stay (each is whole).
        """
        return self._put(keys, source, overwrite=overwrite)

    @property
    def _what(self) -> str:
        return "SharedFsPool"

    def _new_keys(self, keys: list[bytes], overwrite: bool) -> list[bytes]:
        if overwrite:
            return keys
        return [k for k, e in zip(keys, self._exist_all(keys), strict=True) if not e]

    def _store(
        self, keys: list[bytes], source: SlotPool, slots: np.ndarray, checksums: np.ndarray
    ) -> tuple[int, BaseException | None]:
        """Writes one file per block (each published whole); blocks written before an I/O
        error stay."""
        if self._capacity is not None:
            over = self.used + len(keys) - self._capacity
            if over > 0:
                raise TierFullError(
                    f"keys: {len(keys)} new blocks would exceed the capacity of "
                    f"{self._capacity} blocks by {over}; delete blocks first or raise it"
                )
        payload = self.layout.payload_bytes
        jobs: list[tuple[bytes, memoryview, int]] = []
        try:
            for key, slot, checksum in zip(keys, slots.tolist(), checksums.tolist(), strict=True):
                jobs.append((key, source.slot_memory(slot)[:payload], checksum))
            outcomes = self._run_all(self._write_block, jobs, capture=True)
        finally:
            for job in jobs:
                job[1].release()  # nothing may keep the source's memory exported
        written = [o for o in outcomes if not isinstance(o, BaseException)]
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if self.durability == "commit" and written:
            self._sync_dirs({os.path.dirname(p) for p in written})
        if not failed:
            return len(written), None
        first = failed[0]
        if isinstance(first, TpuSyncError):  # names its file; the OSError is its cause
            return len(written), first
        error = _io_error(first, f"writing {len(failed)} of {len(jobs)} blocks")
        error.__cause__ = first
        return len(written), error

    def _reading(self, keys: list[bytes]) -> contextlib.AbstractContextManager[list[bytes]]:
        return readable(keys)  # no index: every key is worth a read (absent: a miss)

    def _load(self, reservation: Reservation, target: SlotPool) -> list[Load]:
        payload = self.layout.payload_bytes
        jobs: list[tuple[bytes, memoryview]] = []
        try:
            for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
                jobs.append((key, target.slot_memory(slot)[:payload]))
            return self._run_all(self._read_block, jobs)
        finally:
            for job in jobs:
                job[1].release()

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a published file exists for each key (its content is checked by ``get``)."""
        self._check_open()
        return self._exist_all(check_keys(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        """Unlinks the files of ``keys`` (readers that already opened one still read it whole);
        absent keys are skipped. Returns how many were removed."""
        self._check_open()
        keys = list(dict.fromkeys(check_keys(keys)))
        removed = 0
        for key in keys:
            try:
                os.unlink(self._path(key))
            except FileNotFoundError:
                continue
            except OSError as exc:
                raise _io_error(exc, f"deleting {key.hex()}") from exc
            removed += 1
        if removed and self.durability == "commit":
            self._sync_dirs({os.path.dirname(self._path(k)) for k in keys})
        self.stats.add(deletes=removed)
        return removed

    def keys(self) -> list[bytes]:
        """Keys of every published block of this layout, sorted (a directory scan: temporary
        files are not blocks and are never listed)."""
        self._check_open()
        out: list[bytes] = []
        for folder in self._fanout_dirs(self._root):
            try:
                entries = os.listdir(folder)
            except FileNotFoundError:
                continue
            prefix = os.path.basename(folder)
            for name in entries:
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[: -len(SUFFIX)])
                except ValueError:
                    continue
                if 1 <= len(key) <= MAX_KEY_BYTES and key[:1].hex() == prefix:
                    out.append(key)
        return sorted(out)

    def sweep(self, older_than_s: float = 3600.0, *, all_layouts: bool = False) -> int:
        """Removes temporary files (left by writers that crashed) older than ``older_than_s``
        seconds, under this layout's directory or, with ``all_layouts``, every layout's.
        Returns how many were removed. A temporary file younger than the longest write may
        belong to a live writer: keep the age well above it (and above clock skew between hosts)."""
        self._check_open()
        if not isinstance(older_than_s, int | float) or older_than_s < 0:
            raise InvalidArgumentError(
                f"older_than_s: expected a non-negative age in seconds, got {older_than_s!r}"
            )
        cutoff = time.time() - older_than_s
        roots = [self._root]
        if all_layouts:
            roots = [e.path for e in os.scandir(self.directory) if e.is_dir(follow_symlinks=False)]
        removed = 0
        for root in roots:
            for folder in [root, *self._fanout_dirs(root)]:
                try:
                    entries = list(os.scandir(folder))
                except (FileNotFoundError, NotADirectoryError):
                    continue
                for entry in entries:
                    if not (entry.name.startswith(".") and TEMP_MARK in entry.name):
                        continue
                    try:
                        if entry.stat(follow_symlinks=False).st_mtime > cutoff:
                            continue
                        os.unlink(entry.path)
                    except FileNotFoundError:
                        continue
                    removed += 1
        return removed

    def close(self) -> None:
        """Stops the I/O threads. The files stay: they are the tier."""
        self._closed = True
        with self._executor_lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

    def __enter__(self) -> SharedFsPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        limit = "unbounded" if self._capacity is None else f"capacity {self._capacity}"
        return (
            f"SharedFsPool({self._root}, {limit}, durability={self.durability!r}, "
            f"{self.layout.payload_bytes} B blocks)"
        )

    # --- files -----------------------------------------------------------------------------

    def path_of(self, key: bytes) -> str:
        """The path a block's file has (whether or not it exists)."""
        return self._path(check_keys([key])[0])

    def _path(self, key: bytes) -> str:
        return f"{self._root}/{key[:1].hex()}/{key.hex()}{SUFFIX}"

    def _exist_all(self, keys: Sequence[bytes]) -> list[bool]:
        """:meth:`_exists` for each key: in this thread when the first few answer as a local
        or cached filesystem does (microseconds; threads would only add handoffs, decision
        0005), else on the I/O threads (a shared filesystem's
        round trips overlap there). The median probe decides, so one preempted call does not."""
        found: list[bool] = []
        times: list[float] = []
        for key in keys[:_STAT_PROBE]:
            start = time.perf_counter()
            found.append(self._exists(key))
            times.append(time.perf_counter() - start)
        rest = keys[len(found) :]
        if not rest:
            return found
        if sorted(times)[len(times) // 2] < _FAST_STAT_S:
            return found + [self._exists(k) for k in rest]
        return found + self._run_all(self._exists, rest)

    def _exists(self, key: bytes) -> bool:
        try:
            os.stat(self._path(key))
        except OSError:
            return False
        return True

    def _write_block(self, job: tuple[bytes, memoryview, int]) -> str:
        """Writes one block to a temporary name and publishes it; returns its path."""
        key, payload, checksum = job
        final = self._path(key)
        folder = os.path.dirname(final)
        self._ensure_dir(folder)
        pid = os.getpid()
        temp = f"{folder}/.{key.hex()}{TEMP_MARK}{_HOST}-{pid}-{uuid.uuid4().hex[:16]}"
        header = encode_block_header(
            key,
            self.layout.fingerprint,
            self.layout.payload_bytes,
            checksum,
            written_ns=time.time_ns(),
            writer=f"{_HOST}:{pid}",
        )
        if self._mac_key is not None:
            section = self._mac_key.seal(header[:HEADER_USED], payload)
            header = header[:HEADER_USED] + section + header[HEADER_USED + len(section) :]
        try:
            fd = open_file(temp, os.O_WRONLY | os.O_EXCL, create=True)  # 0600
        except UnsafeFileError:
            raise
        except OSError as exc:
            raise _io_error(exc, f"creating {temp}") from exc
        try:
            try:
                _pwritev_all(fd, [header, payload])
                if self.durability == "commit":
                    os.fsync(fd)
            finally:
                os.close(fd)  # NFS reports write-back errors here: before the rename
            os.rename(temp, final)
        except BaseException as exc:
            _unlink_quietly(temp)
            if isinstance(exc, OSError):
                raise _io_error(exc, f"writing {final}") from exc
            raise
        return final

    def _read_block(self, job: tuple[bytes, memoryview]) -> Load:
        """Reads one block file into slot memory and checks its header (not yet its payload)."""
        key, memory = job
        path = self._path(key)
        try:
            fd = open_file(path, os.O_RDONLY)
        except FileNotFoundError:
            return Load(LoadStatus.ABSENT)
        except UnsafeFileError as exc:  # a FIFO, a symlink, another uid's: never data
            return Load(LoadStatus.CORRUPT, reason=str(exc), token=_lstat_inode(path))
        except OSError as exc:
            log.warning("tpusync: %s: cannot open: %s", path, exc.strerror)
            return Load(LoadStatus.ERROR, reason=str(exc))
        header = bytearray(HEADER_BYTES)
        try:
            st = os.fstat(fd)
            got = _preadv_all(fd, [header, memory])
        except OSError as exc:
            log.warning("tpusync: %s: cannot read: %s", path, exc.strerror)
            return Load(LoadStatus.ERROR, reason=str(exc))
        finally:
            os.close(fd)
        inode = (st.st_dev, st.st_ino)
        want = HEADER_BYTES + self.layout.payload_bytes
        try:
            parsed = decode_block_header(header[: min(got, HEADER_BYTES)])
            if parsed.key != key:
                raise _Corrupt(f"holds key {parsed.key.hex()}")
            if parsed.fingerprint != self.layout.fingerprint:
                raise _Corrupt(f"holds a block of layout {parsed.fingerprint.hex()}")
            if parsed.payload_bytes != self.layout.payload_bytes:
                raise _Corrupt(f"payload of {parsed.payload_bytes} bytes")
            if got != want or st.st_size != want:
                raise _Corrupt(f"{st.st_size} bytes where a block file has {want}")
            if self._mac_key is not None:
                section = bytes(header[HEADER_USED : HEADER_USED + MAC_BYTES])
                failure = self._mac_key.verify(bytes(header[:HEADER_USED]), section, memory)
                if failure is not None:
                    raise _Corrupt(failure)
        except _Foreign as exc:
            log.info("tpusync: %s: %s; not read", path, exc)
            return Load(LoadStatus.FOREIGN, reason=str(exc))
        except _Corrupt as exc:
            return Load(LoadStatus.CORRUPT, reason=str(exc), token=inode)
        return Load(LoadStatus.OK, checksum=parsed.checksum, token=inode)

    def _discard(self, failed: list[tuple[bytes, Load]]) -> None:
        """Unlinks corrupt files, unless a writer republished the name since they were read
        (an unreadable one stays: the next read may succeed)."""
        for key, load in failed:
            if load.status != LoadStatus.CORRUPT:
                continue
            path = self._path(key)
            log.warning("tpusync: %s: corrupt block file (%s); removing it", path, load.reason)
            with contextlib.suppress(OSError):  # gone, or not ours to remove: a miss either way
                if _lstat_inode(path) == load.token:  # a directory stays (unlink refuses it)
                    os.unlink(path)

    def _prepare_root(self) -> None:
        """Creates this layout's directory and its description file, where writable (a read-only
        mount is fine for readers: ``put`` then fails with a clear error)."""
        try:
            os.mkdir(self._root, DIRECTORY_MODE)
        except FileExistsError:
            pass
        except OSError as exc:
            log.info("tpusync: cannot create %s (%s); read-only use", self._root, exc.strerror)
            return
        _check_shared_directory(self._root, "directory")
        description = os.path.join(self._root, "layout.json")
        if os.path.lexists(description):
            return
        text = json.dumps(
            {"fingerprint": self.layout.fingerprint.hex(), "layout": self.layout.describe()},
            sort_keys=True,
            indent=1,
        )
        try:
            write_file_atomically(
                description,
                (text + "\n").encode(),
                what="writing the layout description",
                sync=self.durability == "commit",
            )
        except (TpuSyncError, OSError) as exc:  # informational only: readers never need it
            log.info("tpusync: %s", exc)

    def _ensure_dir(self, folder: str) -> None:
        if folder in self._known_dirs:
            return
        try:
            os.mkdir(folder, DIRECTORY_MODE)
            if self.durability == "commit":
                self._sync_dirs({os.path.dirname(folder)})
        except FileExistsError:
            pass
        except FileNotFoundError:  # the layout directory was removed meanwhile
            os.makedirs(folder, DIRECTORY_MODE, exist_ok=True)
        _check_shared_directory(folder, "directory")  # blocks are written into it
        self._known_dirs.add(folder)

    def _sync_dirs(self, folders: set[str]) -> None:
        for folder in folders:
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                os.fsync(fd)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                    raise _io_error(exc, f"syncing the directory {folder}") from exc
            finally:
                os.close(fd)

    @staticmethod
    def _fanout_dirs(root: str) -> list[str]:
        try:
            names = os.listdir(root)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [os.path.join(root, n) for n in sorted(names) if _FANOUT.match(n)]

    # --- helpers ----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise PoolClosedError(f"{self!r} is closed; open a new SharedFsPool")
        check_same_process(self._opened_by, f"the shared-FS pool in {self._root}")

    def _check_peer(self, pool: Any, argument: str) -> None:
        if not is_slot_pool(pool):  # e.g. a HostPool
            raise InvalidArgumentError(
                f"{argument}: expected a HostPool (the DRAM tier), got {type(pool).__name__}"
            )
        if pool.layout.fingerprint != self.layout.fingerprint:
            raise InvalidArgumentError(
                f"{argument}: this HostPool holds blocks of another layout (model "
                f"{pool.layout.model_id!r}, fingerprint {pool.layout.fingerprint.hex()}) than "
                f"this SharedFsPool (model {self.layout.model_id!r}, fingerprint "
                f"{self.layout.fingerprint.hex()}); give both the same PoolLayout"
            )

    def _run_all(
        self, fn: Callable[[Any], Any], items: Sequence[Any], *, capture: bool = False
    ) -> list[Any]:
        """``fn`` over ``items`` on the I/O threads; returns only once every call has finished
        (slots handed to a call must not be reused while it runs). With ``capture``, exceptions
        are returned in place of results; otherwise the first one (in item order) is raised.

        Each thread takes the next item until none is left: one task per thread, not per item
        (a future per item costs more than a local ``stat``, and a slow shared filesystem still
        gets its threads; decision 0005)."""
        results: list[Any] = [None] * len(items)
        failed: list[bool] = [False] * len(items)
        if len(items) <= 1 or self.io_threads == 1:
            self._run_items(fn, items, results, failed, iter(range(len(items))), None)
        else:
            executor = self._get_executor()
            indices = _Dealer(len(items))
            stop = threading.Event()
            futures: list[Future[Any]] = [
                executor.submit(self._run_items, fn, items, results, failed, indices, stop)
                for _ in range(min(self.io_threads, len(items)))
            ]
            try:
                wait(futures)
            except BaseException:  # e.g. KeyboardInterrupt: still never return while calls run
                stop.set()
                wait(futures)
                raise
            for future in futures:
                future.result()  # a worker's own failure (not a call's: those are captured)
        if not capture:
            for result, bad in zip(results, failed, strict=True):
                if bad:
                    raise result
        return results

    @staticmethod
    def _run_items(
        fn: Callable[[Any], Any],
        items: Sequence[Any],
        results: list[Any],
        failed: list[bool],
        indices: Iterator[int],
        stop: threading.Event | None,
    ) -> None:
        for i in indices:
            if stop is not None and stop.is_set():
                return
            try:
                results[i] = fn(items[i])
            except Exception as exc:
                results[i], failed[i] = exc, True

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            self._check_open()
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    self.io_threads, thread_name_prefix="tpusync-sharedfs"
                )
            return self._executor


class _Dealer:
    """Hands out 0 .. n-1, each once, to any number of threads (under a lock: a plain
    iterator is not safe to share on a free-threaded interpreter)."""

    def __init__(self, n: int) -> None:
        self._next = 0
        self._n = n
        self._lock = threading.Lock()

    def __iter__(self) -> _Dealer:
        return self

    def __next__(self) -> int:
        with self._lock:
            i = self._next
            if i >= self._n:
                raise StopIteration
            self._next = i + 1
            return i


def _pwritev_all(fd: int, buffers: list[Any]) -> None:
    _vectored(os.pwritev, fd, buffers, stop_at_eof=False)


def _preadv_all(fd: int, buffers: list[Any]) -> int:
    """Fills ``buffers`` from the start of the file; returns the bytes read (short at EOF)."""
    return _vectored(os.preadv, fd, buffers, stop_at_eof=True)


def _vectored(
    op: Callable[[int, list[memoryview], int], int],
    fd: int,
    buffers: list[Any],
    *,
    stop_at_eof: bool,
) -> int:
    """Runs ``pwritev``/``preadv`` from offset 0 until every buffer is done (or EOF). Every view
    it makes is released before it returns or raises: a view left to a traceback would keep a
    DRAM pool from closing."""
    made = [memoryview(b).cast("B") for b in buffers]
    views = list(made)
    done = 0
    try:
        while views:
            n = op(fd, views, done)
            if n <= 0:
                if stop_at_eof:
                    break
                raise OSError(errno.EIO, "the filesystem accepted no bytes")
            done += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if n:
                views[0] = views[0][n:]
                made.append(views[0])
        return done
    finally:
        for view in made:
            view.release()


def _check_shared_directory(path: str, argument: str) -> None:
    """Raises :class:`UnsafeFileError` unless ``path`` is a directory of this uid that others
    cannot write. Hosts that share the tier must run as the same uid."""
    try:
        check_directory(path)
    except UnsafeFileError as exc:
        raise UnsafeFileError(
            f"{argument}: {exc}. A shared-filesystem tier's directories must belong to the uid "
            "every host runs tpusync as, writable by it alone (e.g. mkdir -m 0700 on the "
            "shared filesystem, as that user)"
        ) from None


def _lstat_inode(path: str) -> tuple[int, int] | None:
    """(device, inode) of ``path`` itself (a symlink is not followed), or None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _io_error(exc: BaseException, what: str) -> TpuSyncError:
    if isinstance(exc, TpuSyncError):
        return exc
    if isinstance(exc, OSError):
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return TierFullError(
                f"keys: the shared filesystem is full ({exc.strerror}) while {what}; free space "
                "or delete blocks; every block stored is still whole"
            )
        return TransferFailedError(
            f"{what}: {exc.strerror or exc} ({getattr(exc, 'filename', None) or 'no file'}); "
            "check that the directory is mounted and writable; every block stored is whole"
        )
    return TransferFailedError(f"{what}: {exc!r}")
