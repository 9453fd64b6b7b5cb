"""Inspect and remove named host pools in /dev/shm (the `tpusync shm` command).

Listing never hangs or stops at a bad entry: a damaged pool, a FIFO or a directory named like a
pool, and the temporary files of creators that died are each listed with what is wrong, beside
the good pools. Every file is opened through :func:`tpusync._src.tiers._files.open_file`.
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tpusync._src.tiers._files import open_file
from tpusync._src.tiers.dram._pool_open import size_text
from tpusync._src.tiers.dram._shm_files import (
    DEFAULT_SHM_DIR,
    POOL_NAME,
    TempFile,
    check_sessions_dir,
    find_temp_files,
    header_of_descriptor,
    pool_path,
    read_pool_header,
    remove_sessions_dir,
    remove_stale_temp_files,
    sessions_path,
)
from tpusync._src.tiers.dram.pool_file import (
    HEADER_BYTES,
    RECORD_DTYPE,
    decode_header,
    read_owner_pid,
    scan_records,
)
from tpusync.errors import InvalidArgumentError, PoolBusyError, PoolFormatError, UnsafeFileError

__all__ = [
    "Removed",
    "ShmPoolInfo",
    "header_of_descriptor",
    "list_pools",
    "node_pool_name",
    "node_pool_names",
    "read_pool_header",
    "remove_pool",
    "remove_pools",
    "remove_stale",
    "size_text",
]

_POOL_FILE = re.compile(r"^tpusync-(?P<name>.+)\.pool$")
_SESSIONS = re.compile(r"^tpusync-(?P<name>.+)\.sessions$")


@dataclass(frozen=True)
class ShmPoolInfo:
    """One entry of :func:`list_pools`.

    ``status`` is ``"ok"`` (a pool), ``"damaged"`` (a regular file that is not a pool this build
    reads), ``"unsafe"`` (not a regular file, or another user's: never opened as a pool),
    ``"stale"`` (a temporary file whose creator died: ``tpusync shm remove`` frees it),
    ``"being created"`` (a live creator's temporary file), or ``"orphaned"`` (session
    manifests whose pool is gone); ``error`` says more where it is not ``"ok"``.
    """

    name: str
    path: str
    size_bytes: int
    owner_alive: bool
    owner_pid: int | None
    model_id: str | None
    fingerprint: str | None
    slots: int | None
    used: int | None
    error: str | None  # why the entry is not a usable pool
    status: str = "ok"
    links: int = 1  # the file's hard links: more than one keeps its memory after a remove


@dataclass
class Removed:
    """What :func:`remove_pool` or :func:`remove_stale` removed."""

    paths: list[Path] = field(default_factory=list)
    freed_bytes: int = 0  # memory of the removed files no other link keeps
    links_left: int = 0  # other links that keep the removed pool's memory (none expected)


def _owner_alive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _bad_entry(name: str, path: Path, status: str, error: str, size: int = 0) -> ShmPoolInfo:
    return ShmPoolInfo(name, str(path), size, False, None, None, None, None, None, error, status)


def inspect_pool(path: Path) -> ShmPoolInfo:
    """What the pool file at ``path`` holds (never raises for what the file holds)."""
    name = path.name.removeprefix("tpusync-").removesuffix(".pool")
    try:
        fd = open_file(path, os.O_RDONLY)
    except UnsafeFileError as exc:
        return _bad_entry(name, path, "unsafe", str(exc))
    except OSError as exc:
        return _bad_entry(name, path, "unsafe", f"{path}: cannot open it: {exc.strerror}")
    try:
        info = os.fstat(fd)
        alive = _owner_alive(fd)
        head = os.pread(fd, HEADER_BYTES, 0)
        try:
            header = decode_header(head, info.st_size)
        except PoolFormatError as exc:
            return ShmPoolInfo(
                name, str(path), info.st_size, alive, read_owner_pid(head), None, None,
                None, None, str(exc), "damaged", info.st_nlink,
            )  # fmt: skip
        records = os.pread(fd, header.n_slots * RECORD_DTYPE.itemsize, header.records_offset)
        if len(records) < header.n_slots * RECORD_DTYPE.itemsize:  # truncated meanwhile
            return ShmPoolInfo(
                name, str(path), info.st_size, alive, header.owner_pid, None, None, None,
                None, "truncated while it was read", "damaged", info.st_nlink,
            )  # fmt: skip
        table = np.frombuffer(records, dtype=RECORD_DTYPE, count=header.n_slots)
        scan = scan_records(table, header.layout.payload_bytes)
        return ShmPoolInfo(
            name=name,
            path=str(path),
            size_bytes=info.st_size,
            owner_alive=alive,
            owner_pid=header.owner_pid,
            model_id=header.layout.model_id,
            fingerprint=header.fingerprint.hex(),
            slots=header.n_slots,
            used=len(scan.index),
            error=None,
            links=info.st_nlink,
        )
    finally:
        os.close(fd)


def _temp_entry(temp: TempFile) -> ShmPoolInfo:
    if temp.error is not None:
        return _bad_entry(temp.name, temp.path, "unsafe", temp.error)
    if temp.stale:
        what = "a second link of the pool" if temp.linked else "a half-made pool"
        error = (
            f"temporary file of process {temp.pid}, which died: {what}; `tpusync shm remove` "
            "frees it"
        )
    else:
        error = f"temporary file of process {temp.pid}, creating the pool now"
    status = "stale" if temp.stale else "being created"
    return ShmPoolInfo(
        temp.name, str(temp.path), temp.size_bytes, not temp.stale, temp.pid, None, None, None,
        None, error, status,
    )  # fmt: skip


def list_pools(shm_dir: str = DEFAULT_SHM_DIR) -> list[ShmPoolInfo]:
    """Every ``tpusync-*.pool`` in ``shm_dir``, readable or not, then the temporary files of
    pool creations (stale or not) and session manifests left without their pool."""
    try:
        names = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    pools = [inspect_pool(Path(shm_dir) / n) for n in names if _POOL_FILE.match(n)]
    temps = [_temp_entry(t) for t in find_temp_files(shm_dir)]
    orphans = []
    for entry in names:
        match = _SESSIONS.match(entry)
        if match and not os.path.lexists(pool_path(match["name"], shm_dir)):
            orphans.append(
                _bad_entry(
                    match["name"],
                    Path(shm_dir) / entry,
                    "orphaned",
                    "session manifests of a pool that is gone; `tpusync shm remove "
                    f"{match['name']}` removes them",
                )
            )
    return pools + temps + orphans


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not POOL_NAME.match(name):
        raise InvalidArgumentError(
            f"name: {name!r} is not a pool name (letters, digits, '.', '_' or '-'; see "
            "`tpusync shm list`)"
        )


def remove_pool(name: str, *, force: bool = False, shm_dir: str = DEFAULT_SHM_DIR) -> Removed:
    """Deletes a named pool, the stale temporary files of its name (a creator's that died,
    whatever link of the pool they are) and its KV store's session manifests; refuses while its
    owner lives unless ``force`` (then its owner keeps its memory until it exits, and loses its
    session manifests). Raises :class:`InvalidArgumentError` if there is nothing of that name,
    :class:`PoolBusyError` for a live owner, :class:`UnsafeFileError` if the path is not a
    regular file of this uid (remove that by hand). A refused call removes nothing."""
    _check_name(name)
    path = pool_path(name, shm_dir)
    try:
        fd: int | None = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        fd = None
    removed = Removed()
    try:
        check_sessions_dir(name, shm_dir)  # refused before anything is removed
        if fd is not None:
            if _owner_alive(fd) and not force:
                pid = read_owner_pid(os.pread(fd, HEADER_BYTES, 0))
                raise PoolBusyError(
                    f"name: pool {name!r} is in use by a live process (pid {pid}); stop it "
                    "first, or pass --force (its owner keeps its memory until it exits)"
                )
            if _still_at(path, fd):  # not replaced meanwhile by a new pool
                path.unlink()
                removed.paths.append(path)
        _add_temps(removed, remove_stale_temp_files(shm_dir, name))
        sessions = remove_sessions_dir(name, shm_dir)
        if sessions is not None:
            removed.paths.append(sessions)
        if fd is not None:
            info = os.fstat(fd)
            removed.links_left = info.st_nlink
            if not info.st_nlink and not _owner_alive(fd):
                removed.freed_bytes += info.st_blocks * 512
    finally:
        if fd is not None:
            os.close(fd)
    if not removed.paths:
        raise InvalidArgumentError(f"name: no pool {name!r} in {shm_dir} (see `tpusync shm list`)")
    return removed


def _still_at(path: Path, fd: int) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def remove_stale(shm_dir: str = DEFAULT_SHM_DIR) -> Removed:
    """Deletes every stale temporary file in ``shm_dir`` (pool creations whose process died),
    freeing their memory; leaves pools and live creations alone."""
    removed = Removed()
    _add_temps(removed, remove_stale_temp_files(shm_dir))
    return removed


def _add_temps(removed: Removed, temps: list[TempFile]) -> None:
    for temp in temps:
        if temp.stale:
            removed.paths.append(temp.path)
            if not temp.linked:  # a link of the pool frees nothing by itself
                removed.freed_bytes += temp.size_bytes


def node_pool_name(name: str, fingerprint: bytes) -> str:
    """The pool name a store node called ``name`` (``tpusync serve --name``) gives its pool of
    the block layout with ``fingerprint``: one pool per layout it lends."""
    return f"{name}-{fingerprint.hex()[:16]}"


def node_pool_names(name: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """The names of the pools in ``shm_dir`` that a store node called ``name`` made."""
    _check_name(name)
    node = re.compile(re.escape(f"tpusync-{name}-") + r"[0-9a-f]{16}\.pool")
    try:
        entries = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    return [e.removeprefix("tpusync-").removesuffix(".pool") for e in entries if node.fullmatch(e)]


def remove_pools(name: str, *, force: bool = False, shm_dir: str = DEFAULT_SHM_DIR) -> Removed:
    """What `tpusync shm remove NAME` (or ``--name NAME``) removes: the pool named ``name``
    (:func:`remove_pool`), or, where nothing has that exact name, the pools of the store node
    that ``tpusync serve --name NAME`` ran (one per block layout, :func:`node_pool_name`). Of
    a node's pools, none is removed while the owner of any lives, unless ``force``."""
    _check_name(name)
    exact = pool_path(name, shm_dir)
    own_files = os.path.lexists(exact) or os.path.lexists(sessions_path(name, shm_dir))
    names = [] if own_files else node_pool_names(name, shm_dir)
    if not names:
        return remove_pool(name, force=force, shm_dir=shm_dir)
    if not force:
        for each in names:  # refused before anything is removed
            try:
                fd = open_file(pool_path(each, shm_dir), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if _owner_alive(fd):
                    pid = read_owner_pid(os.pread(fd, HEADER_BYTES, 0))
                    raise PoolBusyError(
                        f"name: pool {each!r} of store node {name!r} is in use by a live process "
                        f"(pid {pid}); stop it first, or pass --force"
                    )
            finally:
                os.close(fd)
    removed = Removed()
    for each in names:
        done = remove_pool(each, force=force, shm_dir=shm_dir)
        removed.paths += done.paths
        removed.freed_bytes += done.freed_bytes
        removed.links_left += done.links_left
    return removed
