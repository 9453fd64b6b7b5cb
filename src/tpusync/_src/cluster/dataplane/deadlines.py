"""The absolute deadlines of the data plane's operations, which no peer can move.

A pull's receiving ends at its lease's deadline (DEADLINE_FRACTION of the granted TTL), which
each renewal the server grants moves on (the timing rule of
:mod:`tpusync._src.cluster.dataplane.leases`); a server that trickles bytes and keeps granting
renewals could move it forever. So every pull also has a **cap**: ``max_pull_s`` after it
started, past which no renewal moves its deadline. A push has one deadline for all its frames
and answers, ``max_push_s`` after it started (a timeout per send would let a peer that takes a
byte now and then hold the pusher forever). A server's get has one for its frames too, and a
store node's put for its frames to arrive: the server's ``lease_max_s``.

Either limit defaults to :func:`limit_for` the operation's bytes: ``DEFAULT_FLOOR_S`` plus the
bytes at ``DEFAULT_FLOOR_BYTES_PER_S`` (generous for any link a cluster runs on; a peer slower
than that is treated as stalled). A missed deadline raises
:class:`~tpusync.errors.DeadlineExceededError` (a TimeoutError: the peer's circuit opens at
once), naming the option to raise.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tpusync._src.cluster.tcp_server import check_seconds
from tpusync.errors import DeadlineExceededError

__all__ = [
    "DEFAULT_FLOOR_BYTES_PER_S",
    "DEFAULT_FLOOR_S",
    "MAX_LIMIT_S",
    "Deadline",
    "check_limit",
    "limit_for",
]

DEFAULT_FLOOR_S = 30.0  # every operation gets this long at least
DEFAULT_FLOOR_BYTES_PER_S = 32 << 20  # and this long for its bytes at 32 MiB/s (~270 Mbit/s)
MAX_LIMIT_S = 86400.0


def check_limit(value: Any, argument: str) -> float | None:
    """``value`` as an operation's limit in seconds (None: :func:`limit_for` decides)."""
    if value is None:
        return None
    return check_seconds(value, argument, MAX_LIMIT_S, "or None (scaled from the bytes moved)")


def limit_for(limit_s: float | None, nbytes: int) -> float:
    """The limit of an operation moving ``nbytes``: ``limit_s`` when given, else
    DEFAULT_FLOOR_S plus the bytes at DEFAULT_FLOOR_BYTES_PER_S."""
    if limit_s is not None:
        return limit_s
    return min(DEFAULT_FLOOR_S + max(nbytes, 0) / DEFAULT_FLOOR_BYTES_PER_S, MAX_LIMIT_S)


class Deadline:
    """An operation's deadline in monotonic seconds: ``at`` is when it passes as things stand
    (read again at every wait), ``cap`` the latest it may ever be: :meth:`move_to` never goes
    past it. ``option`` and ``limit_s`` name the cap in the error, ``what`` (optional) what
    missed it, ``fix`` what to do (default: raise the client's option). The clients' logs and
    results name the peer."""

    __slots__ = ("at", "cap", "fix", "limit_s", "option", "what")

    def __init__(
        self,
        at: float,
        cap: float = math.inf,
        *,
        option: str = "",
        limit_s: float = 0.0,
        what: str = "",
        fix: str = "",
    ) -> None:
        self.cap = cap
        self.at = min(at, cap)
        self.option, self.limit_s, self.what = option, limit_s, what
        self.fix = fix or (
            f"raise {option} (BlockClient(..., {option}=...)) for larger transfers or slower links"
        )

    @classmethod
    def within(cls, limit_s: float, *, option: str, what: str = "", fix: str = "") -> Deadline:
        """A deadline ``limit_s`` from now that nothing moves (``option`` set it)."""
        end = time.monotonic() + limit_s
        return cls(end, end, option=option, limit_s=limit_s, what=what, fix=fix)

    def bounded(self, at: float) -> Deadline:
        """A deadline at ``at`` (e.g. a lease's) under this one's cap."""
        return Deadline(
            at, self.cap, option=self.option, limit_s=self.limit_s, what=self.what, fix=self.fix
        )

    def move_to(self, at: float) -> None:
        """Moves the deadline to ``at`` (a granted lease renewal), never past the cap."""
        self.at = min(at, self.cap)

    def left(self) -> float:
        """Seconds left (<= 0: passed)."""
        return self.at - time.monotonic()

    def missed(self) -> DeadlineExceededError:
        """The error to raise once it passed: the cap's, naming its option, or the lease's."""
        what = f"{self.what}: " if self.what else ""
        if self.at >= self.cap:
            return DeadlineExceededError(
                f"{what}not finished within {self.option}={self.limit_s:g} s, its limit "
                f"whatever the peer does; {self.fix}"
            )
        return DeadlineExceededError(
            f"{what}the lease's deadline passed (the server did not renew it in time: it "
            "refused, did not answer, or its lease_max_s was reached)"
        )
