"""Failures of the KV store's lower tiers, counted per tier and logged once per run of them.

A tier that is full or failing (a disk whose filesystem has no room for its slab files, a shared
filesystem that refuses writes) fails every write-back and demotion that reaches it, while the
tiers beside it go on taking the blocks. Logging each failure would bury the log; logging none
would hide it. So the first failure of a run is logged with the tier's name, where it lives and
the error; repeats within ``interval_s`` are only counted and summed up in the next line; the
first success after a run says the tier works again.

A tier that cannot be reached (a store node or peer that is down, stopped or too slow: a
connection error or a timeout) also rests: it is not asked again for a while (one second,
doubling with each failure that follows, at most a minute), so each operation does not wait out
its timeout again. Only the background work (write-back, lookups, loads) asks it once a rest is
over; the path a save waits for (making room in DRAM) leaves it alone until one of those finds
it working again.
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
REST_FIRST_S = 1.0
REST_LONGEST_S = 60.0


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
        self._rest_s = [0.0] * len(names)  # the last rest's length; 0: the tier is reachable
        self._rest_until = [0.0] * len(names)

    def label(self, tier: int) -> str:
        """The tier's name and where it lives, e.g. ``disk (/mnt/ssd/kv)``."""
        return self._labels[tier]

    def failed(self, tier: int, what: str, error: BaseException) -> None:
        """Counts a failure of ``tier`` doing ``what`` (e.g. "write-back of 4 blocks"); logs it
        when it starts a run of failures or the last line is ``interval_s`` old."""
        now = time.monotonic()
        with self._lock:
            self._rest_after(tier, error, now)
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

    def unreachable(self, tier: int, error: BaseException) -> None:
        """Notes a failure that its caller reports itself: the tier rests when ``error`` says
        it cannot be reached."""
        with self._lock:
            self._rest_after(tier, error, time.monotonic())

    def _rest_after(self, tier: int, error: BaseException, now: float) -> None:
        if not isinstance(error, ConnectionError | TimeoutError):
            return
        rest = self._rest_s[tier]
        rest = min(rest * 2, REST_LONGEST_S) if rest else REST_FIRST_S
        self._rest_s[tier], self._rest_until[tier] = rest, now + rest

    def resting(self, tier: int) -> bool:
        """Whether ``tier`` could not be reached and its rest is not over: ask it nothing."""
        return bool(self._rest_s[tier]) and time.monotonic() < self._rest_until[tier]

    def unreached(self, tier: int) -> bool:
        """Whether ``tier`` could not be reached and nothing has reached it since (the path a
        save waits for asks it nothing then, even after its rest)."""
        return bool(self._rest_s[tier])

    def reached(self, tier: int) -> None:
        """Notes that ``tier`` answered (a lookup or a read): ends its rest, not a run of
        failures (a full disk answers lookups, and still fails writes)."""
        if self._rest_s[tier]:
            with self._lock:
                self._rest_s[tier] = 0.0

    def worked(self, tier: int) -> None:
        """Notes a success of ``tier``: ends a run of failures (and says so) and its rest."""
        if self._logged_at[tier] is None and not self._rest_s[tier]:
            return  # the usual case: no run to end (a racy read is fine)
        with self._lock:
            self._rest_s[tier] = 0.0
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
