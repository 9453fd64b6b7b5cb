"""The files of named host pools in a shm directory: their names, and the leftovers of creators
that died.

A named pool ``NAME`` is ``tpusync-NAME.pool``; a KV store keeps its offloaded sessions' manifests
beside it in ``tpusync-NAME.sessions/``. A pool is set up in an unnamed file (``O_TMPFILE``) and
then linked to its name, which leaves nothing behind a kill; where that is not possible (and in
older builds) it is created under a temporary name, ``.tpusync-NAME.pool.tmp-PID-TID``, fully set
up there, then linked to its name and the temporary name unlinked. A creator killed before the
unlink leaves that temporary file behind, holding its memory: before the link it is a half-made
pool nobody will use; after it, a second link of the pool itself, which keeps the pool's memory
after the pool's name is removed.

A creator holds an exclusive ``flock`` on its temporary file from just after creating it until
it unlinks it, so a temporary file is stale when nobody holds that lock and its creator's pid is
gone (or the file is older than any creation's unlocked moments could be, for a pid reused since).
A temporary file that is a link of the pool is stale once its creator's pid is gone (the pool's
owner may hold the lock on it then).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from tpusync._src.tiers._files import open_file
from tpusync._src.tiers.dram.pool_file import HEADER_BYTES, PoolHeader, decode_header
from tpusync.errors import UnsafeFileError

__all__ = [
    "DEFAULT_SHM_DIR",
    "POOL_NAME",
    "TempFile",
    "check_sessions_dir",
    "creating",
    "find_temp_files",
    "header_of_descriptor",
    "pool_path",
    "read_pool_header",
    "remove_sessions_dir",
    "remove_stale_temp_files",
    "sessions_path",
    "temp_path",
]

DEFAULT_SHM_DIR = "/dev/shm"
POOL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")
_TEMP = re.compile(r"^\.tpusync-(?P<name>.+)\.pool\.tmp-(?P<pid>\d+)-(?P<tid>\d+)$")
# A live creator leaves its temporary file unlocked only for moments (between creating and
# locking it, and between linking and unlinking it); an unlocked one older than this is stale
# even where its pid now names another process.
STALE_AFTER_S = 60.0

# The temporary files this process is creating now: a file named with this process's pid that
# is not among them is a leftover of an earlier process that had the same pid.
creating: set[str] = set()  # their names


def pool_path(name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path:
    """Where the named pool ``name`` lives."""
    return Path(shm_dir) / f"tpusync-{name}.pool"


def sessions_path(name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path:
    """Where a KV store keeps the session manifests of its named pool ``name``."""
    return Path(shm_dir) / f"tpusync-{name}.sessions"


def temp_path(pool: Path, pid: int, tid: int) -> Path:
    """The temporary name a creator (process ``pid``, thread ``tid``) sets ``pool`` up under."""
    return pool.parent / f".{pool.name}.tmp-{pid}-{tid}"


@dataclass(frozen=True)
class TempFile:
    """A pool's temporary file, as :func:`find_temp_files` found it."""

    path: Path
    name: str  # the pool it was made for
    pid: int  # its creator
    size_bytes: int  # what it holds in memory (its allocated blocks)
    stale: bool  # its creator is gone: the file may be removed
    linked: bool  # it is a second link of the pool (the creator died between link and unlink)
    error: str | None = None  # why it could not be inspected (e.g. not a regular file)

    @property
    def status(self) -> str:
        if self.error is not None:
            return "unsafe"
        return "stale" if self.stale else "being created"


def _creator_gone(pid: int, changed_at: float) -> bool:
    """Whether the process that named a temporary file with ``pid`` (last changed at
    ``changed_at``) is gone: no process has that pid, or the one that has it started later."""
    if pid == os.getpid():
        return False  # the caller checks ``creating``
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        pass
    started = _start_time(pid)
    return started is not None and started > changed_at + 1  # btime is in whole seconds


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), or None where /proc says not."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _same_file(a: os.stat_result, b: os.stat_result | None) -> bool:
    return b is not None and (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _inspect_temp(path: Path, name: str, pid: int, *, remove: bool) -> TempFile | None:
    """Classifies one temporary file (and with ``remove``, unlinks it if stale, under its lock
    where it can take it). None if it is gone meanwhile."""
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        return TempFile(path, name, pid, 0, False, False, str(exc))
    try:
        info = os.fstat(fd)
        # A second link of the pool (its creator died between link and unlink, or is about to
        # unlink it): removing that name loses nothing, whoever holds the lock.
        linked = _same_file(info, _lstat(pool_path(name, path.parent)))
        stale = linked or _unlocked_and_gone(fd, path, pid, info.st_ctime)
        if stale and remove and _same_file(info, _lstat(path)):  # still that file
            path.unlink(missing_ok=True)
        return TempFile(path, name, pid, info.st_blocks * 512, stale, linked)
    finally:
        os.close(fd)  # drops the lock


def _unlocked_and_gone(fd: int, path: Path, pid: int, changed_at: float) -> bool:
    """Whether a half-made pool's creator is gone: nobody holds its lock, and its pid is gone,
    or it is this process's pid but not a file it is creating, or it is old."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its creator is at work
    if pid == os.getpid():
        return path.name not in creating
    return _creator_gone(pid, changed_at) or time.time() - changed_at > STALE_AFTER_S


def find_temp_files(
    shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR, name: str | None = None
) -> list[TempFile]:
    """The pools' temporary files in ``shm_dir`` (of pool ``name`` only, if given), stale or
    not, sorted by path; changes nothing."""
    return _temp_files(shm_dir, name, remove=False)


def remove_stale_temp_files(
    shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR, name: str | None = None
) -> list[TempFile]:
    """Unlinks the stale temporary files in ``shm_dir`` (of pool ``name`` only, if given), which
    frees their memory; returns what it found, stale ones removed."""
    return _temp_files(shm_dir, name, remove=True)


def _temp_files(
    shm_dir: str | os.PathLike[str], name: str | None, *, remove: bool
) -> list[TempFile]:
    prefix = ".tpusync-" if name is None else f".tpusync-{name}.pool.tmp-"
    found = []
    try:
        with os.scandir(shm_dir) as scan:
            entries = sorted(e.name for e in scan if e.name.startswith(prefix))
    except OSError:  # missing or not a directory: whoever uses it next says so
        return []
    for entry in entries:
        match = _TEMP.match(entry)
        if match is None or (name is not None and match["name"] != name):
            continue
        temp = _inspect_temp(Path(shm_dir) / entry, match["name"], int(match["pid"]), remove=remove)
        if temp is not None:
            found.append(temp)
    return found


def read_pool_header(path: str | os.PathLike[str]) -> PoolHeader:
    """The decoded header of the pool file at ``path``, opened safely (no link followed, no
    wait on a FIFO, only a regular file of this uid). Raises
    :class:`~tpusync.errors.PoolFormatError` if it is not a pool this build reads,
    :class:`UnsafeFileError` if it is not a safe regular file, ``FileNotFoundError`` if it is
    missing."""
    fd = open_file(path, os.O_RDONLY)
    try:
        return header_of_descriptor(fd)
    finally:
        os.close(fd)


def header_of_descriptor(fd: int) -> PoolHeader:
    """The decoded header of the pool file open at ``fd`` (checked against its size now);
    :class:`~tpusync.errors.PoolFormatError` if it is not a pool this build reads."""
    return decode_header(os.pread(fd, HEADER_BYTES, 0), os.fstat(fd).st_size)


def check_sessions_dir(name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR) -> Path | None:
    """The session manifests directory kept beside pool ``name`` if there is one (None if not),
    after checking that it may be removed: a directory (not a link to one) of this uid, else
    :class:`UnsafeFileError`."""
    directory = sessions_path(name, shm_dir)
    info = _lstat(directory)
    if info is None:
        return None
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeFileError(
            f"{directory}: expected the directory of a KV store's session manifests, found "
            "something else; remove it by hand"
        )
    _check_owner_uid(info, directory)
    return directory


def _check_owner_uid(info: os.stat_result, path: Path) -> None:
    """Refuses to remove another user's files (root may, by accident)."""
    if info.st_uid != os.geteuid():
        raise UnsafeFileError(
            f"{path}: owned by uid {info.st_uid}, not by this process's uid {os.geteuid()}; "
            "remove it as its owner"
        )


def remove_sessions_dir(
    name: str, shm_dir: str | os.PathLike[str] = DEFAULT_SHM_DIR
) -> Path | None:
    """Removes the session manifests kept beside pool ``name`` (checked as
    :func:`check_sessions_dir` does); returns the directory, or None if there was none."""
    directory = check_sessions_dir(name, shm_dir)
    if directory is not None:
        shutil.rmtree(directory)  # manifests only; rmtree follows no links inside
    return directory
