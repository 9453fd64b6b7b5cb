"""Real tmpfs mounts for the tests that need a filesystem of a given size (full disks, full
/dev/shm). Mounting needs root; where it is missing the test fails rather than skips, so that
CI (which runs as root) can never hide such a test."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=30)


def mount_tmpfs(where: Path, options: str) -> None:
    """Mounts a fresh tmpfs (mode 0700: tiers refuse directories others may write) at the
    existing directory ``where``, with mount ``options`` such as ``size=2m``."""
    if os.geteuid() != 0:
        pytest.fail("this test mounts a tmpfs and needs root (CI runs as root)")
    result = _run("mount", "-t", "tmpfs", "-o", f"mode=0700,{options}", "tmpfs", str(where))
    if result.returncode:
        pytest.fail(f"cannot mount a tmpfs at {where}: {result.stderr.strip()}")


def unmount(where: Path) -> None:
    if _run("umount", str(where)).returncode:
        _run("umount", "-l", str(where))


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs at the new directory ``where`` for the ``with`` block, unmounted on exit."""
    where.mkdir()
    mount_tmpfs(where, options)
    try:
        yield where
    finally:
        unmount(where)
