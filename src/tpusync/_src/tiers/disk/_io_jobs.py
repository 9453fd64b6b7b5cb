"""How a disk pool runs its I/O: jobs spread over its I/O threads, every worker finished before
the call returns, and the choice of O_DIRECT for its directory (see
:mod:`tpusync._src.tiers.disk.pool`)."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tpusync._src.tiers.direct_io import check_o_direct
from tpusync.errors import InvalidArgumentError

__all__ = ["choose_direct_io", "run_jobs"]


def run_jobs(
    executor: ThreadPoolExecutor | None,
    threads: int,
    fn: Callable[[Any], None],
    jobs: Sequence[Any],
    *,
    stop_on_error: bool,
) -> dict[int, OSError]:
    """Runs ``fn`` on every job on up to ``threads`` of ``executor``'s threads (the calling
    thread alone for one); returns the OSErrors by job index. ``stop_on_error``: the first
    OSError stops the jobs not yet started.

    Every worker has finished when this returns (no I/O touches a slot afterwards)."""
    if not jobs:
        return {}
    assert executor is not None  # open pools have one; close() waits for I/O in flight
    queue = deque(enumerate(jobs))
    errors: dict[int, OSError] = {}
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            try:
                i, job = queue.popleft()
            except IndexError:
                return
            try:
                fn(job)
            except OSError as exc:
                errors[i] = exc
                if stop_on_error:
                    stop.set()
            except BaseException:
                stop.set()
                raise

    n = min(len(jobs), threads)
    if n == 1:
        worker()
    else:
        futures = [executor.submit(worker) for _ in range(n)]
        for future in futures:
            future.exception()  # waits for every worker before anything is re-raised
        for future in futures:
            future.result()
    return dict(sorted(errors.items()))


def choose_direct_io(directory: Path, wanted: bool | str) -> tuple[bool, str]:
    """Whether the pool in ``directory`` reads and writes with O_DIRECT, and why: ``wanted``
    True requires it (a clear error where the filesystem refuses it), "auto" uses it where
    it works, False never."""
    if wanted is False:
        return False, "direct_io=False"
    if not hasattr(os, "O_DIRECT"):
        ok, reason = False, "this OS has no O_DIRECT"
    else:
        ok, reason = check_o_direct(str(directory))
    if wanted is True and not ok:
        raise InvalidArgumentError(
            f"direct_io: O_DIRECT is not available in {directory} ({reason}); pass "
            "direct_io='auto' to fall back to buffered I/O"
        )
    return ok, "O_DIRECT supported" if ok else f"O_DIRECT unavailable: {reason}"
