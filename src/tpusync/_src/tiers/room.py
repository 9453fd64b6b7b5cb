"""Room checks made when a tier or a server starts, so that a size or a path that cannot work is
refused at once, naming the argument, instead of failing (or filling another filesystem) at the
first write.

* :func:`check_room`: ``need`` bytes fit in memory (``MemAvailable`` of ``/proc/meminfo``) or in a
  directory's filesystem (``statvfs``), counting what the caller already holds there (a restart
  re-attaches its files: their room is taken already).
* :func:`check_writable_directory`: a directory exists, is a directory, and a file can be made in
  it (a read-only mount, ``/proc`` and a full disk are found here, not at the first write).

The checks are a snapshot: another process may take the room afterwards. The writes that come
later keep their own errors (:class:`~tpusync.errors.TierFullError` on ENOSPC).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tpusync.errors import InvalidArgumentError, TierFullError

__all__ = ["check_room", "check_writable_directory", "held_bytes", "memory_available"]

MEMINFO = "/proc/meminfo"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def memory_available(meminfo: str = MEMINFO) -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where the kernel does not say)."""
    try:
        with open(meminfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    number, _, unit = value.strip().partition(" ")
                    return int(number) * (1024 if unit.strip().lower() == "kb" else 1)
    except (OSError, ValueError):
        return None
    return None


def held_bytes(paths: list[Path]) -> int:
    """Bytes the files ``paths`` (and the files in those that are directories) occupy."""
    total = 0
    for path in paths:
        try:
            if path.is_dir() and not path.is_symlink():
                total += held_bytes(list(path.iterdir()))
            elif path.is_file() and not path.is_symlink():
                total += path.lstat().st_blocks * 512
        except OSError:
            continue  # removed meanwhile: it holds nothing
    return total


def check_room(
    argument: str,
    need: int,
    *,
    directory: str | os.PathLike[str] | None = None,
    held: int = 0,
    fix: str = "give a smaller size",
) -> None:
    """Raises :class:`TierFullError` unless ``need`` bytes fit: in memory (``directory`` None:
    ``MemAvailable``), or in ``directory``'s filesystem (its free room for this uid). ``held`` is
    what the caller already holds there (counted as room). The message names ``argument``, both
    sizes and ``fix``. Where memory cannot be read, nothing is refused."""
    if directory is None:
        free = memory_available()
        if free is None:
            return
        where, what = "this host has", "of memory available"
        source = f"MemAvailable in {MEMINFO}"
    else:
        try:
            st = os.statvfs(directory)
        except OSError as exc:
            raise InvalidArgumentError(
                f"{argument}: cannot check the room in {os.fspath(directory)}: "
                f"{exc.strerror or exc}"
            ) from None
        free = st.f_bavail * st.f_frsize
        where, what = f"{os.fspath(directory)} has", "free"
        source = f"of {_size(st.f_blocks * st.f_frsize)}"
    room = free + held
    if need > room:
        also = f", with {_size(held)} already held there" if held else ""
        raise TierFullError(
            f"{argument}: {_size(need)} asked for, but {where} {_size(free)} {what} ({source}"
            f"{also}); {fix}"
        )


def check_writable_directory(argument: str, directory: str | os.PathLike[str]) -> Path:
    """Raises :class:`InvalidArgumentError` unless ``directory`` exists, is a directory, and a
    file can be created in it (tried: a temporary file, removed at once)."""
    path = Path(os.fspath(directory))
    if not path.exists():
        raise InvalidArgumentError(
            f"{argument}: {path} does not exist; create it (or mount its filesystem) first"
        )
    if not path.is_dir():
        raise InvalidArgumentError(f"{argument}: {path} is not a directory; give a directory")
    try:
        with tempfile.TemporaryFile(dir=path, prefix=".tpusync-probe-"):
            pass
    except OSError as exc:
        raise InvalidArgumentError(
            f"{argument}: cannot create files in {path}: {exc.strerror or exc}; give a "
            "writable directory"
        ) from None
    return path
