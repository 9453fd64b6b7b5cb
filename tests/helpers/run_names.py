"""Names of what the tests make outside their ``tmp_path`` (pool files in /dev/shm, temporary
directories, the session's base temporary directory), each carrying this test run's tag: runs
beside each other (another session of the same user, another worktree) never see or remove each
other's, and a leak check looks at this run's names only, never at everything in /dev/shm
(issue 54).

The tag is made once per pytest session and reaches child processes as ``TPUSYNC_TEST_RUN``."""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

RUN_TAG = os.environ.setdefault("TPUSYNC_TEST_RUN", f"tpt-{secrets.token_hex(4)}")


def run_name(kind: str) -> str:
    """A fresh name of this run, ``<tag>-<kind>-<12 hex digits>`` (a valid pool name)."""
    return f"{RUN_TAG}-{kind}-{uuid.uuid4().hex[:12]}"


def run_entries(
    directory: str | os.PathLike[str] = "/dev/shm", within: str = RUN_TAG
) -> list[Path]:
    """The entries of ``directory`` whose name contains ``within`` (default: this run's tag):
    what this run (or the part of it that ``within`` names) made there and left."""
    return sorted(p for p in Path(directory).iterdir() if within in p.name)
