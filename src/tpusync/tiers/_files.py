"""Opening a tier's files and directories without trusting what sits at the path.

/dev/shm, /tmp and shared directories may hold whatever another process put there: a FIFO (an
open would block forever), a directory where a file belongs, a symlink, or a file another user
owns or can write (who could then read or forge blocks). Every tier opens its files here:

* never follows a symlink in the last component, never blocks on open (``O_NONBLOCK``);
* then ``fstat``\\s the open descriptor (not the path, which may change in between) and refuses
  anything but a regular file (or a directory, for directories);
* refuses a file or directory that another uid owns, or that its group or others may write.
  Root bypasses file modes, so these checks come from ``fstat``, never from a failed open.

Files are created 0600 and directories 0700.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from tpusync.errors import UnsafeFileError

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "check_descriptor",
    "check_directory",
    "check_owner",
    "make_directory",
    "open_file",
]

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def check_descriptor(fd: int, path: str | os.PathLike[str], *, directory: bool = False) -> None:
    """Raises :class:`UnsafeFileError` unless ``fd`` (an open ``path``) is a regular file (or a
    directory) that this uid owns and that neither its group nor others may write."""
    info = os.fstat(fd)
    wanted = stat.S_ISDIR if directory else stat.S_ISREG
    if not wanted(info.st_mode):
        expected = "a directory" if directory else "a regular file"
        raise UnsafeFileError(
            f"{os.fspath(path)}: expected {expected}, found {_kind(info.st_mode)}; "
            "remove it or choose another path"
        )
    check_owner(info, path)


def check_owner(info: os.stat_result, path: str | os.PathLike[str]) -> None:
    """Raises :class:`UnsafeFileError` if another uid owns ``path`` or others may write it."""
    uid = os.geteuid()
    if info.st_uid != uid:
        raise UnsafeFileError(
            f"{os.fspath(path)}: owned by uid {info.st_uid}, not by this process's uid {uid}; "
            "another user could read or forge its blocks: remove it (as its owner or root) or "
            "choose another path"
        )
    if info.st_mode & _UNSAFE_BITS:
        raise UnsafeFileError(
            f"{os.fspath(path)}: mode {stat.S_IMODE(info.st_mode):04o} lets other users write "
            f"it; run chmod go-w on it (tpusync creates files 0600 and directories 0700)"
        )


def open_file(path: str | os.PathLike[str], flags: int, *, create: bool = False) -> int:
    """Opens a tier file safely (see the module docstring) and returns its descriptor, in
    blocking mode. With ``create``, ``O_CREAT`` is added and a new file gets mode 0600.

    Raises :class:`UnsafeFileError` for a symlink, a FIFO, a directory, another uid's file or
    one others may write; ``FileNotFoundError`` and other ``OSError``\\s pass through.
    """
    flags |= os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EMLINK):  # O_NOFOLLOW met a symlink
            raise UnsafeFileError(
                f"{os.fspath(path)}: is a symlink; tpusync never follows links to its files: "
                "remove it or choose another path"
            ) from None
        if error.errno == errno.EISDIR:
            raise UnsafeFileError(
                f"{os.fspath(path)}: expected a regular file, found a directory; remove it or "
                "choose another path"
            ) from None
        if error.errno == errno.ENXIO:  # O_WRONLY on a FIFO without a reader
            raise UnsafeFileError(
                f"{os.fspath(path)}: expected a regular file, found a FIFO; remove it or choose "
                "another path"
            ) from None
        raise
    try:
        check_descriptor(fd, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_directory(path: str | os.PathLike[str]) -> None:
    """Raises :class:`UnsafeFileError` unless ``path`` is a directory (not a symlink to one) this
    uid owns that its group and others cannot write; ``FileNotFoundError`` if it is missing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ENOTDIR, errno.ELOOP):
            kind = "a symlink" if os.path.islink(path) else "not a directory"
            raise UnsafeFileError(
                f"{os.fspath(path)}: expected a directory, found {kind}; remove it or choose "
                "another path"
            ) from None
        raise
    try:
        check_descriptor(fd, path, directory=True)
    finally:
        os.close(fd)


def make_directory(path: str | os.PathLike[str]) -> Path:
    """Creates ``path`` (mode 0700; missing parents too) unless it exists, then checks it as
    :func:`check_directory` does."""
    os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)
    check_directory(path)
    return Path(path)
