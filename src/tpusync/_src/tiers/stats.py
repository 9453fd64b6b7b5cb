"""Per-tier counters in one place, for stats() and for a Prometheus exporter to read."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

__all__ = ["TierStats", "all_tier_stats"]

_registry: weakref.WeakSet[TierStats] = weakref.WeakSet()
_registry_lock = threading.Lock()


@dataclass(eq=False)
class TierStats:
    """Counters of one tier. Plain integers: updates are cheap and reads never block."""

    tier: str
    bytes_in: int = 0
    bytes_out: int = 0
    puts: int = 0
    hits: int = 0
    misses: int = 0
    checksum_failures: int = 0
    deletes: int = 0
    evictions: int = 0
    torn_discarded: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        with _registry_lock:
            _registry.add(self)

    def add(self, **counts: int) -> None:
        """Adds to counters atomically (``+=`` from several threads could lose counts)."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def served(self, hits: int, misses: int, bytes_out: int) -> None:
        """A get's counts: :meth:`add` without its keyword loop (a load's hot path)."""
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.bytes_out += bytes_out

    def as_dict(self) -> dict[str, int | str]:
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


def all_tier_stats() -> list[TierStats]:
    """Every live tier's counters (what a metrics exporter scrapes)."""
    with _registry_lock:
        return list(_registry)
