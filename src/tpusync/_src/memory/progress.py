"""A small progress report for long work (prefaulting large pools, long copies).

On a terminal it redraws one line on stderr; elsewhere (logs, CI) it logs a start and an end
line. No dependency: a progress bar must never be the reason an install fails.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("tpusync")


class Progress:
    """``with Progress("prefaulting pool", total_bytes) as p: ... p.advance(n)``."""

    def __init__(self, label: str, total: int, *, unit: str = "GiB", scale: float = 2**30) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.unit = unit
        self.scale = scale
        self.tty = sys.stderr.isatty()
        self._start = time.perf_counter()
        self._last_draw = 0.0

    def __enter__(self) -> Progress:
        if not self.tty:
            log.info("tpusync: %s (%.2f %s)...", self.label, self.total / self.scale, self.unit)
        return self

    def advance(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        now = time.perf_counter()
        if self.tty and (now - self._last_draw > 0.1 or self.done == self.total):
            self._last_draw = now
            width = 30
            filled = int(width * self.done / self.total)
            bar = "#" * filled + "-" * (width - filled)
            sys.stderr.write(
                f"\r{self.label} [{bar}] {self.done / self.scale:.2f}/"
                f"{self.total / self.scale:.2f} {self.unit}"
            )
            sys.stderr.flush()

    def __exit__(self, *exc: object) -> None:
        seconds = time.perf_counter() - self._start
        if self.tty:
            sys.stderr.write(f" {seconds:.1f} s\n")
            sys.stderr.flush()
        else:
            log.info("tpusync: %s done in %.1f s", self.label, seconds)
