"""Opening a tier's files and directories without trusting what sits at the path.

/dev/shm, /tmp and shared directories may hold whatever another process put there: a FIFO (an
open would block forever), a directory where a file belongs, a symlink, or a file another user
owns or can write (who could then read or forge blocks). Every tier opens its files here:

* never follows a symlink in the last component, never blocks on open (``O_NONBLOCK``);
* then ``fstat``\\s the open descriptor (not the path, which may change in between) and refuses
  anything but a regular file (or a directory, for directories);
* refuses a file or directory that another uid owns, or that its group or others may write.
  Root bypasses file modes, so these checks come from ``fstat``, never from a failed open.

Files are created 0600 and directories 0700. A private file (the deployment secret) is read
by :func:`read_private_file` under the same rules, and stricter ones: nobody else may even
read it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path

from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = [
    "DIRECTORY_MODE",
    "FILE_MODE",
    "check_descriptor",
    "check_directory",
    "check_owner",
    "check_shm_dir",
    "make_directory",
    "open_file",
    "read_private_file",
]

FILE_MODE = 0o600
DIRECTORY_MODE = 0o700
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH
_OPEN_ERRORS = {  # what O_NOFOLLOW | O_NONBLOCK opens refuse with, by errno
    errno.ELOOP: "a symlink",
    errno.EMLINK: "a symlink",  # O_NOFOLLOW on a symlink, on some kernels
    errno.ENXIO: "a socket or a FIFO without a writer",
    errno.EISDIR: "a directory",
}


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


def _symlink_text(path: str | os.PathLike[str]) -> str:
    try:
        target = os.readlink(path)
    except OSError:
        return "a symlink"
    return f"a symlink to {target}"


def check_directory(path: str | os.PathLike[str], *, argument: str | None = None) -> None:
    """Raises :class:`UnsafeFileError` unless ``path`` is a directory (not a symlink to one) this
    uid owns that its group and others cannot write; ``FileNotFoundError`` if it is missing.
    ``argument``, when given, starts the message (the config key or flag that named it)."""
    prefix = "" if argument is None else f"{argument}: "
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in (errno.ENOTDIR, errno.ELOOP):
            if os.path.islink(path):  # the link's holder could repoint it after any check
                raise UnsafeFileError(
                    f"{prefix}{os.fspath(path)}: expected a directory, found "
                    f"{_symlink_text(path)}; tpusync never follows a link to its directories: "
                    "give the directory itself"
                ) from None
            raise UnsafeFileError(
                f"{prefix}{os.fspath(path)}: expected a directory, found not a directory; "
                "remove it or choose another path"
            ) from None
        raise
    try:
        check_descriptor(fd, path, directory=True)
    except UnsafeFileError as exc:
        raise UnsafeFileError(f"{prefix}{exc}") from None
    finally:
        os.close(fd)


def check_shm_dir(path: str | os.PathLike[str], argument: str = "shm_dir") -> None:
    """Refuses a directory for named pools that another user could tamper with, before anything
    is made in it: it must exist, be a directory (not a symlink to one), belong to this uid or
    to root (as /dev/shm does), and, if its group or others may write it, be sticky (as /dev/shm,
    mode 1777, is: nobody may then remove or rename another user's files). Raises
    :class:`~tpusync.errors.InvalidArgumentError` (missing, not a directory) or
    :class:`UnsafeFileError` (a symlink, another user's, writable by others without the sticky
    bit), naming ``argument`` and the fix."""
    where = os.fspath(path)
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise InvalidArgumentError(
            f"{argument}: cannot use {where}: {exc.strerror or exc}; create it (mkdir -m 0700) or "
            "give another directory (the default is /dev/shm)"
        ) from None
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeFileError(
            f"{argument}: {where} is {_symlink_text(path)}; tpusync never follows a link to its "
            "directories: give the directory itself"
        )
    if not stat.S_ISDIR(info.st_mode):
        kind = "a regular file" if stat.S_ISREG(info.st_mode) else _kind(info.st_mode)
        raise InvalidArgumentError(
            f"{argument}: {where} is not a directory but {kind}; give a directory (the default "
            "is /dev/shm)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # replaced since the lstat, or not searchable
        raise InvalidArgumentError(f"{argument}: cannot use {where}: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    uid = os.geteuid()
    if info.st_uid not in (uid, 0):
        owners = f"this process's uid {uid}" + (" or root" if uid else "")
        raise UnsafeFileError(
            f"{argument}: {where} is owned by uid {info.st_uid}, not by {owners}; its owner "
            "could remove or replace the pool's files: give a directory of your own (mkdir -m "
            "0700) or /dev/shm"
        )
    if info.st_mode & _UNSAFE_BITS and not info.st_mode & stat.S_ISVTX:
        raise UnsafeFileError(
            f"{argument}: {where} has mode {stat.S_IMODE(info.st_mode):04o}: other users may "
            "remove or replace the pool's files; run chmod go-w on it, or chmod +t (sticky, as "
            "/dev/shm's 1777)"
        )


def make_directory(path: str | os.PathLike[str]) -> Path:
    """Creates ``path`` (mode 0700; missing parents too) unless it exists, then checks it as
    :func:`check_directory` does."""
    os.makedirs(path, mode=DIRECTORY_MODE, exist_ok=True)
    check_directory(path)
    return Path(path)


def read_private_file(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The contents of a small private file (a secret), read without trusting the path.

    ``path`` is opened without following a symlink or waiting on a FIFO (``O_NOFOLLOW |
    O_NONBLOCK``; a device or socket is refused by ``lstat`` before any open), then the open
    descriptor must be a regular file of this uid with no permission bits for its group or
    others, of at most ``max_bytes``. Raises :class:`UnsafeFileError` naming the path and the
    fix; ``FileNotFoundError`` and other ``OSError``\\s of the open pass through.
    """
    info = os.lstat(path)  # a FileNotFoundError passes through
    if not stat.S_ISREG(info.st_mode):  # before any open: opening a device may do something
        raise UnsafeFileError(
            f"{os.fspath(path)}: expected a regular file, found {_kind(info.st_mode)}; give "
            "the file itself (mode 0600)"
        )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as error:
        if error.errno in _OPEN_ERRORS:  # replaced by something else since the lstat
            raise UnsafeFileError(
                f"{os.fspath(path)}: expected a regular file, found {_OPEN_ERRORS[error.errno]}; "
                "give the file itself (mode 0600)"
            ) from None
        raise
    try:
        info = os.fstat(fd)  # what was opened, whatever the path names now
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(
                f"{os.fspath(path)}: expected a regular file, found {_kind(info.st_mode)}; give "
                "the file itself (mode 0600)"
            )
        uid = os.geteuid()
        if info.st_uid != uid:
            raise UnsafeFileError(
                f"{os.fspath(path)}: owned by uid {info.st_uid}, not by this process's uid "
                f"{uid}; copy it (as this user) to a file only this user can read (mode 0600)"
            )
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise UnsafeFileError(
                f"{os.fspath(path)}: mode {stat.S_IMODE(info.st_mode):04o} lets other users "
                "read or change it; run chmod 600 on it (and make a new secret if others may "
                "have read it)"
            )
        if info.st_size > max_bytes:
            raise UnsafeFileError(
                f"{os.fspath(path)}: {info.st_size} bytes, more than the {max_bytes} bytes "
                "expected; give the file that holds only the secret"
            )
        chunks: list[bytes] = []
        left = max_bytes + 1  # one more: a file that grew since the fstat is refused too
        while left > 0:
            piece = os.read(fd, left)
            if not piece:
                break
            chunks.append(piece)
            left -= len(piece)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise UnsafeFileError(
            f"{os.fspath(path)}: more than the {max_bytes} bytes expected (it grew while read); "
            "give the file that holds only the secret"
        )
    return data
