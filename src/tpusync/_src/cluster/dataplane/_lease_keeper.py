"""A pull's lease kept alive while its stripes receive, on a pool thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor

__all__ = ["LeaseKeeper"]


class LeaseKeeper:
    """Calls ``renew`` every ``every_s`` seconds on a thread of ``executor`` until the context
    is left or ``renew`` answers False (refused or failed: the stripes then stop at their
    deadline). Leaving the context stops it without waiting for its thread: no renewal starts
    after that, and one under way is waited for, so the lease's release never races it."""

    def __init__(self, executor: Executor, renew: Callable[[], bool], every_s: float) -> None:
        self._executor, self._renew, self._every_s = executor, renew, every_s
        self._done = threading.Event()
        self._lock = threading.Lock()

    def __enter__(self) -> LeaseKeeper:
        self._executor.submit(self._run)
        return self

    def _run(self) -> None:
        while not self._done.wait(self._every_s):
            with self._lock:
                if self._done.is_set() or not self._renew():
                    return

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._done.set()
