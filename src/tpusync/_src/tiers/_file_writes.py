"""Writing a tier's small files whole or not at all, and the error for a failed file operation.

A full filesystem or a failing disk must surface as a tpusync error that names the file and the
cause, never as a bare ``OSError`` without a path, and must leave nothing half-written where a
reader looks: :func:`write_file_atomically` writes under a temporary name beside the final one
(created 0600 through :func:`tpusync._src.tiers._files.open_file`), renames it into place, and
removes the temporary file on any failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid

from tpusync._src.tiers._files import open_file
from tpusync.errors import TierFullError, TierIOError, UnsafeFileError

__all__ = [
    "NO_SPACE",
    "TEMP_MARK",
    "file_error",
    "temp_path",
    "write_all",
    "write_file_atomically",
]

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
TEMP_MARK = ".tmp-"  # temporary names are ".<final name>.tmp-<pid>-<random>"


def file_error(
    exc: OSError, path: str | os.PathLike[str], what: str
) -> TierFullError | TierIOError:
    """The tpusync error for ``what`` (a gerund phrase: "writing the session manifest") of
    ``path`` failing with ``exc``: :class:`TierFullError` when the filesystem has no room,
    :class:`TierIOError` (carrying ``exc.errno``) otherwise. Raise it ``from exc``."""
    path = os.fspath(path)
    cause = exc.strerror or str(exc)
    if exc.errno in NO_SPACE:
        return TierFullError(
            f"{path}: {what} failed: {cause}{_free_space(os.path.dirname(path) or '.')}; free "
            "space on that filesystem, or give the tier less capacity or another directory"
        )
    error = TierIOError(
        f"{path}: {what} failed: {cause}; check that its filesystem is mounted, writable and "
        "healthy"
    )
    error.errno = exc.errno  # str() stays the message: only errno is set, not strerror/filename
    return error


def _free_space(directory: str) -> str:
    try:
        st = os.statvfs(directory)
    except OSError:
        return ""
    return (
        f" (the filesystem has {st.f_bavail * st.f_frsize / 2**20:.1f} MiB free of "
        f"{st.f_blocks * st.f_frsize / 2**20:.1f} MiB)"
    )


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written."""
    view = memoryview(data).cast("B")
    try:
        while view:
            n = os.write(fd, view)
            if n <= 0:
                raise OSError(errno.EIO, "the filesystem accepted no bytes")
            view = view[n:]
    finally:
        view.release()


def temp_path(path: str | os.PathLike[str]) -> str:
    """A fresh temporary name beside ``path`` (a dot name: readers never open it)."""
    directory, name = os.path.split(os.fspath(path))
    return os.path.join(directory, f".{name}{TEMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:16]}")


def write_file_atomically(
    path: str | os.PathLike[str], data: bytes, *, what: str, sync: bool = True
) -> None:
    """Writes ``data`` to ``path`` (mode 0600): to a temporary name first, ``fsync``\\ed when
    ``sync``, then renamed over ``path``. Readers see the old file, the new one or none.

    Raises :func:`file_error`'s error (``what`` names the file's role) with the temporary file
    removed and ``path`` untouched; :class:`~tpusync.errors.UnsafeFileError` if something unsafe
    sits at the temporary name (it never does: the name is fresh and opened ``O_EXCL``)."""
    temp = temp_path(path)
    try:
        fd = open_file(temp, os.O_WRONLY | os.O_EXCL, create=True)
    except UnsafeFileError:
        raise
    except OSError as exc:
        raise file_error(exc, path, what) from exc
    try:
        try:
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)  # NFS reports write-back errors here: before the rename
        os.rename(temp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError):
            raise file_error(exc, path, what) from exc
        raise
