"""Failures of the KV store's lower tiers, counted per tier and logged once per run of them.

A tier that is full or failing (a disk whose filesystem has no room for its slab files, a shared
filesystem that refuses writes) fails every write-back and demotion that reaches it, while the
tiers beside it go on taking the blocks. Logging each failure would bury the log; logging none
would hide it. So the first failure of a run is logged with the tier's name, where it lives and
the error; repeats within ``interval_s`` are only counted and summed up in the next line; the
first success after a run says the tier works again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("tpusync.kv")

DEFAULT_INTERVAL_S = 60.0


def tier_location(tier: Any) -> str:
    """Where a tier keeps its blocks, for messages: its directory or path, else the name its
    counters go by (e.g. ``remote:<peer>``), else its type's name."""
    for name in ("directory", "path"):
        where = getattr(tier, name, None)
        if isinstance(where, str | os.PathLike):
            return os.fspath(where)
    label = getattr(getattr(tier, "stats", None), "tier", None)
    return label if isinstance(label, str) else type(tier).__name__


class TierFaults:
    """Counts and logs the failures of each tier (by index into ``names``). Thread-safe."""

    def __init__(
        self, names: Sequence[str], tiers: Sequence[Any], *, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        pairs = zip(names, tiers, strict=True)
        self._labels = [f"{name} ({tier_location(tier)})" for name, tier in pairs]
        self._names = list(names)
        self._interval = interval_s
        self._lock = threading.Lock()
        self._total = [0] * len(names)  # failures ever
        self._unlogged = [0] * len(names)  # failures since the last line about the tier
        self._logged_at: list[float | None] = [None] * len(names)  # None: the tier works

    def label(self, tier: int) -> str:
        """The tier's name and where it lives, e.g. ``disk (/mnt/ssd/kv)``."""
        return self._labels[tier]

    def failed(self, tier: int, what: str, error: BaseException) -> None:
        """Counts a failure of ``tier`` doing ``what`` (e.g. "write-back of 4 blocks"); logs it
        when it starts a run of failures or the last line is ``interval_s`` old."""
        now = time.monotonic()
        with self._lock:
            self._total[tier] += 1
            last = self._logged_at[tier]
            if last is not None and now - last < self._interval:
                self._unlogged[tier] += 1
                return
            repeats, self._unlogged[tier] = self._unlogged[tier], 0
            self._logged_at[tier] = now
        more = f" ({repeats} more failures of it since the last report)" if repeats else ""
        log.warning(
            "tpusync kv: tier %s failed: %s: %s%s; the other tiers still get the blocks "
            "(repeats are reported at most every %.0f s)",
            self._labels[tier],
            what,
            error,
            more,
            self._interval,
        )

    def worked(self, tier: int) -> None:
        """Notes a success of ``tier``: ends a run of failures (and says so)."""
        if self._logged_at[tier] is None:  # the usual case: no run to end (a racy read is fine)
            return
        with self._lock:
            if self._logged_at[tier] is None:
                return
            repeats, self._unlogged[tier] = self._unlogged[tier], 0
            self._logged_at[tier] = None
        log.warning(
            "tpusync kv: tier %s works again%s",
            self._labels[tier],
            f" ({repeats} more failures of it since the last report)" if repeats else "",
        )

    def failing(self, tier: int) -> bool:
        """Whether ``tier`` is in a run of failures (its last attempt failed)."""
        return self._logged_at[tier] is not None

    def failures(self) -> dict[str, int]:
        """Failures so far per tier name (tiers that never failed are left out)."""
        with self._lock:
            return {name: n for name, n in zip(self._names, self._total, strict=True) if n}
