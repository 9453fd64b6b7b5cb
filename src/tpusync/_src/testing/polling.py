"""Waiting in tests for what another thread or process does: poll a condition, with a
timeout that names what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["eventually"]


def eventually(
    condition: Callable[[], object],
    timeout: float = 5.0,
    what: str = "the condition",
    interval: float = 0.01,
) -> float:
    """Polls ``condition`` every ``interval`` seconds until it is true; returns the seconds
    it took. AssertionError naming ``what`` when it is still false after ``timeout`` s."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start
