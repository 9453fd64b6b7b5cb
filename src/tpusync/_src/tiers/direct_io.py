"""Whether a directory's filesystem takes ``O_DIRECT`` opens: the disk tier asks before it reads
around the page cache, and :func:`tpusync.info` reports it."""

from __future__ import annotations

import errno
import os
import tempfile

__all__ = ["check_o_direct"]


def check_o_direct(directory: str) -> tuple[bool, str]:
    """Whether files in ``directory`` can be opened with O_DIRECT, and why not."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False, "this OS has no O_DIRECT"
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".tpusync-odirect-")
    except OSError as exc:
        return False, f"cannot create a file there: {exc.strerror}"
    os.close(fd)
    try:
        fd = os.open(name, os.O_RDWR | flag)
    except OSError as exc:
        reason = "the filesystem refuses it" if exc.errno == errno.EINVAL else exc.strerror
        return False, str(reason)
    else:
        os.close(fd)
        return True, "supported"
    finally:
        os.unlink(name)
