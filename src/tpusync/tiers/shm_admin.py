"""Inspect and remove named host pools in /dev/shm (the `tpusync shm` command)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tpusync.errors import InvalidArgumentError, PoolBusyError, PoolFormatError
from tpusync.tiers._pool_file import (
    COMMITTED,
    HEADER_BYTES,
    RECORD_DTYPE,
    decode_header,
    read_owner_pid,
)
from tpusync.tiers.host_pool import DEFAULT_SHM_DIR, pool_path

__all__ = ["ShmPoolInfo", "list_pools", "remove_pool"]


@dataclass(frozen=True)
class ShmPoolInfo:
    name: str
    path: str
    size_bytes: int
    owner_alive: bool
    owner_pid: int | None
    model_id: str | None
    fingerprint: str | None
    slots: int | None
    used: int | None
    error: str | None  # why the file could not be read as a pool


def _owner_alive(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def inspect_pool(path: Path) -> ShmPoolInfo:
    name = path.name.removeprefix("tpusync-").removesuffix(".pool")
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        alive = _owner_alive(fd)
        with open(fd, "rb", closefd=False) as f:
            head = f.read(HEADER_BYTES)
            try:
                header = decode_header(head, size)
            except PoolFormatError as exc:
                return ShmPoolInfo(
                    name,
                    str(path),
                    size,
                    alive,
                    read_owner_pid(head),
                    None,
                    None,
                    None,
                    None,
                    str(exc),
                )
            f.seek(header.records_offset)
            records = np.frombuffer(
                f.read(header.n_slots * RECORD_DTYPE.itemsize), dtype=RECORD_DTYPE
            )
        return ShmPoolInfo(
            name=name,
            path=str(path),
            size_bytes=size,
            owner_alive=alive,
            owner_pid=header.owner_pid,
            model_id=str(header.description.get("model_id")),
            fingerprint=header.fingerprint.hex(),
            slots=header.n_slots,
            used=int(np.count_nonzero(records["state"] == COMMITTED)),
            error=None,
        )
    finally:
        os.close(fd)


def list_pools(shm_dir: str = DEFAULT_SHM_DIR) -> list[ShmPoolInfo]:
    """Every ``tpusync-*.pool`` in ``shm_dir``, readable or not."""
    return [inspect_pool(p) for p in sorted(Path(shm_dir).glob("tpusync-*.pool"))]


def remove_pool(name: str, *, force: bool = False, shm_dir: str = DEFAULT_SHM_DIR) -> Path:
    """Deletes a named pool; refuses while its owner lives unless ``force``."""
    path = pool_path(name, shm_dir)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise InvalidArgumentError(
            f"name: no pool {name!r} in {shm_dir} (see `tpusync shm list`)"
        ) from None
    try:
        if _owner_alive(fd) and not force:
            pid = inspect_pool(path).owner_pid
            raise PoolBusyError(
                f"name: pool {name!r} is in use by a live process (pid {pid}); stop it first, "
                "or pass --force (its owner keeps its memory until it exits)"
            )
        path.unlink()
    finally:
        os.close(fd)
    return path
