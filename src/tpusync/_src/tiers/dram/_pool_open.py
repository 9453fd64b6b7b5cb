"""Opening a named host pool's file: attach to it, refuse it, or create it (for HostPool).

* Stale temporary files of this pool's name (left by creators that died) are removed first.
* The file is opened through :func:`tpusync._src.tiers._files.open_file` (no link followed, no wait
  on a FIFO, a regular file of this uid only) and locked (``flock``: one owner at a time).
* A file that holds another model, block layout, number of slots, or that is damaged or of
  another format, is refused with ``on_mismatch="error"`` (the default), naming what differs and
  how to replace it, and left as it is; with ``"recreate"`` it is unlinked (the warning names
  the path and why) and a cold pool made in its place. A file that is not a safe regular file is
  always refused (:class:`~tpusync.errors.UnsafeFileError`): it is nothing of ours to remove.
* A new pool is made in an unnamed file (``O_TMPFILE``), set up in full, locked, and only then
  linked to its name, so a creator killed at any moment leaves nothing behind. Where the
  filesystem has no ``O_TMPFILE`` (or there is no /proc) it is made under a temporary name
  (see :mod:`tpusync._src.tiers.dram._shm_files`) that the next open or ``tpusync shm remove``
  frees if its creator dies.

Every failure closes what it opened: no descriptor (and so no lock) outlives a failed open.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tpusync._native import core as _core
from tpusync._src.tiers._files import check_descriptor, check_shm_dir, open_file
from tpusync._src.tiers.dram._shm_files import (
    DEFAULT_SHM_DIR,
    creating,
    remove_stale_temp_files,
    temp_path,
)
from tpusync._src.tiers.dram.pool_file import (
    HEADER_BYTES,
    PoolGeometry,
    PoolHeader,
    decode_header,
    encode_header,
    read_owner_pid,
)
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.room import check_room
from tpusync.errors import InvalidArgumentError, PoolBusyError, PoolFormatError, TierFullError

__all__ = [
    "OpenedPool",
    "check_before_opening",
    "map_file",
    "open_named_pool",
    "pool_bytes",
    "size_text",
    "write_header",
]

log = logging.getLogger("tpusync.tiers")

ON_MISMATCH = ("error", "recreate")
_USE_TMPFILE = True  # False: always the temporary-name path (the tests of that path set it)
_ATTEMPTS = 8  # opens raced by other processes' creations or replacements before giving up

# what a creation calls to touch every page of the new mapping (HostPool's prefault), or None
Prefault = Callable[[_core.Mapping, str], None] | None


@dataclass(frozen=True)
class OpenedPool:
    """A named pool's file, locked by ``fd`` (the owner's descriptor) and mapped."""

    fd: int
    mapping: _core.Mapping
    attached: bool  # an existing pool (False: created cold)


def pool_bytes(layout: PoolLayout, capacity: int) -> int:
    """The bytes a host pool of ``capacity`` slots of ``layout`` maps: its header, records and
    slots (a named pool's file size)."""
    return PoolGeometry(layout, capacity).file_bytes


def check_before_opening(geometry: PoolGeometry, name: str | None, shm_dir: str) -> None:
    """Refuses a pool before anything is mapped or made: a named one in a directory another
    user could tamper with (:func:`~tpusync._src.tiers._files.check_shm_dir`; its room there is
    checked where its file is made), an anonymous one larger than the memory available."""
    if name is not None:
        check_shm_dir(shm_dir, "shm_dir")
    else:
        check_room(
            "capacity",
            geometry.file_bytes,
            fix=f"lower the capacity ({geometry.n_slots} slots of {geometry.layout.slot_bytes} B)",
        )


def open_named_pool(
    path: Path, name: str, geometry: PoolGeometry, *, populate: Prefault, on_mismatch: str
) -> OpenedPool:
    """Attaches to the pool at ``path`` if it holds ``geometry``, else refuses or recreates it
    (``on_mismatch``); creates it if it is missing, touching its pages with ``populate`` if
    given. See the module docstring."""
    remove_stale_temp_files(path.parent, name)
    for _ in range(_ATTEMPTS):
        try:
            fd = open_file(path, os.O_RDWR)
        except FileNotFoundError:
            opened = _create(path, geometry, populate)
            if opened is not None:
                return opened
            continue  # another process published the pool meanwhile: open that one
        try:
            opened, replace = _attach(fd, path, name, geometry, on_mismatch)
        except BaseException:
            os.close(fd)
            raise
        if opened is not None:
            return opened
        if replace:
            os.unlink(path)  # under our lock: no owner is using it
        os.close(fd)
    raise PoolBusyError(
        f"name: the pool {path} changed under this open {_ATTEMPTS} times (other processes "
        "creating or replacing it); open it again once they are done"
    )


def _attach(
    fd: int, path: Path, name: str, geometry: PoolGeometry, on_mismatch: str
) -> tuple[OpenedPool | None, bool]:
    """(the opened pool, False) if ``fd`` holds ``geometry``; (None, True) if it is to be
    replaced; (None, False) if ``path`` names another file by now (open again)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise PoolBusyError(
            f"name: the pool {path} is owned by a live process (pid {_owner_pid(fd)}); use "
            "another name, or stop that process first"
        ) from None
    info = os.fstat(fd)
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None, False
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
        return None, False  # replaced by another process between our open and our lock
    try:
        header: PoolHeader | None = decode_header(os.pread(fd, HEADER_BYTES, 0), info.st_size)
        problem = None
    except PoolFormatError as exc:
        header, problem = None, f"it is damaged or not a pool this build reads ({exc})"
    if header is not None:
        problem = _difference(header, geometry)
    if problem is None:
        return OpenedPool(fd, map_file(fd, geometry.file_bytes), attached=True), False
    if on_mismatch == "error":
        raise PoolFormatError(f"{path}: {problem}; {_how_to_replace(name, path.parent)}")
    log.warning(
        'tpusync: %s: %s; on_mismatch="recreate": starting a cold pool in its place',
        path,
        problem,
    )
    return None, True


def _difference(header: PoolHeader, geometry: PoolGeometry) -> str | None:
    """What differs between the pool's header and the pool asked for (None: nothing)."""
    held, wanted = header.layout, geometry.layout
    if held.model_id != wanted.model_id:
        return f"it holds another model's blocks (model {held.model_id!r}, not {wanted.model_id!r})"
    if held.fingerprint != wanted.fingerprint:
        return (
            f"it holds another block layout of model {held.model_id!r} "
            f"({_layout_text(held)}, not {_layout_text(wanted)})"
        )
    if header.n_slots != geometry.n_slots:
        return f"it holds another size ({header.n_slots} slots, not {geometry.n_slots})"
    return None


def _layout_text(layout: PoolLayout) -> str:
    parts = [
        f"{a.name} {a.dtype}{list(a.shard_block_shape)} axis {a.block_axis} x{a.n_shards}"
        for a in layout.arrays[:3]
    ]
    more = f" and {len(layout.arrays) - 3} more" if len(layout.arrays) > 3 else ""
    return "; ".join(parts) + more


def _how_to_replace(name: str, shm_dir: Path) -> str:
    where = "" if os.fspath(shm_dir) == DEFAULT_SHM_DIR else f" --dir {shm_dir}"
    return (
        "nothing was changed. To replace it with a cold pool (its blocks are lost), pass "
        'on_mismatch="recreate" (in a KV store: DramTier(on_mismatch="recreate")) or run '
        f"`tpusync shm{where} remove {name}`; or use another name"
    )


# --- creating ----------------------------------------------------------------------------------


def _create(path: Path, geometry: PoolGeometry, populate: Prefault) -> OpenedPool | None:
    """A new cold pool at ``path``, or None if another process published one there first."""
    global _USE_TMPFILE
    try:
        return _create_once(path, geometry, populate)
    except _CannotLinkUnnamed as exc:  # e.g. /proc links refused: use a temporary name
        log.info("tpusync: %s: cannot link an unnamed file (%s); using a temporary name", path, exc)
        _USE_TMPFILE = False
        return _create_once(path, geometry, populate)


class _CannotLinkUnnamed(Exception):
    """The O_TMPFILE file could not be linked to its name (nothing was published)."""


def _create_once(path: Path, geometry: PoolGeometry, populate: Prefault) -> OpenedPool | None:
    directory = path.parent
    need = geometry.file_bytes
    _check_room(directory, need)
    with _directory_fd(directory) as dir_fd:
        fd, temp = _new_file(directory, path)
        mapping = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, need)  # reserve now: a full tmpfs fails here, not later
            except OSError as exc:
                raise TierFullError(
                    f"capacity: cannot reserve {size_text(need)} in {directory}: {exc.strerror}"
                ) from None
            mapping = map_file(fd, need)
            if populate is not None:
                populate(mapping, f"prefaulting {path}")
            write_header(mapping, geometry)
            # Visible under its name only when fully set up; link() never replaces a pool that
            # another process published meanwhile (rename() would).
            _publish(fd, temp, path, dir_fd)
        except FileExistsError:
            _discard(fd, mapping, temp)
            return None
        except BaseException:
            _discard(fd, mapping, temp)
            raise
    return OpenedPool(fd, mapping, attached=False)


def _check_room(directory: Path, need: int) -> None:
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise InvalidArgumentError(f"shm_dir: cannot use {directory}: {exc.strerror}") from None
    free = st.f_bavail * st.f_frsize
    if free < need:
        raise TierFullError(
            f"capacity: the pool needs {size_text(need)} but {directory} has {size_text(free)} "
            f"free of {size_text(st.f_blocks * st.f_frsize)}; lower the capacity or enlarge it "
            "(e.g. docker run --shm-size)"
        )


@contextmanager
def _directory_fd(directory: Path) -> Iterator[int]:
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidArgumentError(f"shm_dir: cannot use {directory}: {exc.strerror}") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _new_file(directory: Path, path: Path) -> tuple[int, Path | None]:
    """A new empty file (mode 0600) for the pool at ``path`` and its temporary name: None for
    an unnamed one (``O_TMPFILE``)."""
    if _USE_TMPFILE and hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"):
        try:
            fd = os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
        else:
            try:
                check_descriptor(fd, path)
            except BaseException:
                os.close(fd)
                raise
            return fd, None
    temp = temp_path(path, os.getpid(), threading.get_ident())
    creating.add(temp.name)
    try:
        try:
            return open_file(temp, os.O_RDWR | os.O_EXCL, create=True), temp
        except FileExistsError:  # left by an earlier process of this pid: this thread's name
            temp.unlink(missing_ok=True)
            return open_file(temp, os.O_RDWR | os.O_EXCL, create=True), temp
    except BaseException:
        creating.discard(temp.name)
        raise


def _publish(fd: int, temp: Path | None, path: Path, dir_fd: int) -> None:
    """Links the set-up file to its name (FileExistsError if a pool has it already)."""
    if temp is None:  # linkat(AT_SYMLINK_FOLLOW) of the descriptor's /proc link
        try:
            os.link(
                f"/proc/self/fd/{fd}",
                path.name,
                src_dir_fd=dir_fd,
                dst_dir_fd=dir_fd,
                follow_symlinks=True,
            )
        except FileExistsError:
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):
                raise
            raise _CannotLinkUnnamed(exc.strerror) from None
        return
    os.link(temp, path)
    with contextlib.suppress(FileNotFoundError):  # a sweep may have removed this second link
        os.unlink(temp)
    creating.discard(temp.name)


def _discard(fd: int, mapping: _core.Mapping | None, temp: Path | None) -> None:
    if mapping is not None:
        mapping.close()
    os.close(fd)
    if temp is not None:
        temp.unlink(missing_ok=True)
        creating.discard(temp.name)


# --- shared with HostPool ----------------------------------------------------------------------


def write_header(mapping: _core.Mapping, geometry: PoolGeometry) -> None:
    """Writes the header of ``geometry`` with this process as its owner. The magic and version
    go last: rewriting an attached pool's header changes only its owner pid (outside the
    checksum) or, for a version 1 pool, upgrades it; a kill mid-write leaves a readable one."""
    header = encode_header(geometry, os.getpid())
    view = memoryview(mapping)
    view[12 : len(header)] = header[12:]
    view[:12] = header[:12]


def map_file(lock_fd: int, size: int) -> _core.Mapping:
    """Maps the pool file that ``lock_fd`` holds the owner's flock on, through a second open
    of it: a mapping keeps its open file alive, and so would the lock on it (flock belongs to
    the open file, not the descriptor), e.g. while the kernel collapses the pages into huge
    ones after close() unmapped them. The lock must go with the descriptor."""
    try:
        map_fd = os.open(f"/proc/self/fd/{lock_fd}", os.O_RDWR)  # the same file, a new open
    except OSError:  # no /proc: map the locked open itself
        return _core.Mapping(size, populate=False, huge_pages=True, fd=lock_fd)
    try:
        return _core.Mapping(size, populate=False, huge_pages=True, fd=map_fd)
    finally:
        os.close(map_fd)


def size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _owner_pid(fd: int) -> int | None:
    try:
        return read_owner_pid(os.pread(fd, HEADER_BYTES, 0))
    except OSError:
        return None
