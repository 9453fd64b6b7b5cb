"""Leases: remote readers' pins on a HostPool's blocks, which expire.

A peer that pulls blocks first takes a lease on them (:meth:`LeaseTable.acquire`): the present
keys are pinned in the pool (:meth:`HostPool.pin`), so they are neither deleted nor their slots
reused, and their recorded checksums are handed out. The lease lasts ``ttl_s`` seconds unless
renewed; when it lapses, its pins are dropped (by an expiry thread, and lazily on every call), so a
reader that died never holds blocks for longer than its TTL. A reader that lives and keeps
renewing holds them no longer than ``max_lifetime_s`` after its acquire (a block server's
``lease_max_s``, default 600 s): a renewal that would carry the lease past that is refused
(False), and the lease lapses at its last granted deadline. The expiry thread is restarted if it
dies of a bug (:mod:`tpusync._src.cluster.supervisor`).

The timing rule (what makes a pull safe without trusting the reader's liveness):

* a reader's deadline for the whole pull, measured from before it sends the acquire request,
  must be shorter than the TTL it was granted; a reader that runs out of time stops and keeps
  nothing it has not finished. A long pull renews the lease (every third of its TTL, on a
  connection of its own) and, after each renewal the server grants, moves its deadline to the
  same fraction of a TTL after the renewal was asked (never past its own limit, ``max_pull_s``:
  a refused renewal leaves its deadline where it was, inside the lease);
* the reader commits the blocks it pulled only if :meth:`LeaseTable.release` answered True --
  the lease was held the whole time, never expired before the release. Otherwise it discards
  them all (they may have been read from slots that were freed and reused meanwhile).

(The data plane's server also pins the slots of each block while sending it, and every block is
verified against the checksum recorded at acquire time: the release rule is the second guard.)
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync._src.cluster.tcp_server import DEFAULT_LEASE_MAX_S, check_lease_lifetime
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.slots import Pinned
from tpusync.errors import InvalidArgumentError, TierFullError

__all__ = ["Lease", "LeaseTable"]

MAX_TTL_S = 3600.0
MAX_LEASES = 65536


@dataclass(frozen=True)
class Lease:
    """A granted lease: ``present[i]`` says whether ``keys[i]`` was present (and is now
    pinned); ``checksums[i]`` is its recorded block checksum (0 where absent); ``slots[i]``
    its slot in the pool (-1 where absent), for readers on the same host."""

    lease_id: int
    keys: list[bytes]
    present: list[bool]
    checksums: list[int]
    ttl_s: float
    slots: list[int] = field(default_factory=list)


class _Held:
    __slots__ = ("deadline", "ends", "lease", "pinned")

    def __init__(self, lease: Lease, pinned: Pinned, deadline: float, ends: float) -> None:
        self.lease = lease
        self.pinned = pinned
        self.deadline = deadline
        self.ends = ends  # no renewal carries the lease past this


def _check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not 0 < ttl_s <= MAX_TTL_S:
        raise InvalidArgumentError(f"ttl_s: expected seconds in (0, {MAX_TTL_S:g}], got {ttl_s!r}")
    return float(ttl_s)


class LeaseTable:
    """The leases on one :class:`HostPool`'s blocks.

    Args:
      pool: the pool whose blocks are leased.
      clock: monotonic seconds (tests may pass their own; the expiry thread then still sleeps
        in real time, and every call expires what is due by ``clock``).
      max_leases: leases held at once beyond which :meth:`acquire` raises TierFullError.
      max_lifetime_s: the longest a lease lives, renewals included (see the module docstring);
        a TTL asked beyond it is granted only up to it.
      on_failure: called with its last exception if the expiry thread keeps dying and is
        given up on (leases still lapse on every call then).
    """

    def __init__(
        self,
        pool: HostPool,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_leases: int = MAX_LEASES,
        max_lifetime_s: float = DEFAULT_LEASE_MAX_S,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(f"pool: expected a HostPool, got {type(pool).__name__}")
        self._pool = pool
        self._clock = clock
        self._max_leases = int(max_leases)
        self.max_lifetime_s = check_lease_lifetime(max_lifetime_s, "max_lifetime_s")
        self._cond = threading.Condition()
        self._held: dict[int, _Held] = {}
        self._closed = False
        self.expired = 0  # leases that lapsed before their release (a counter)
        self.renewals_refused = 0  # renewals past a lease's max_lifetime_s (a counter)
        self.loop = SupervisedLoop(
            self._expiry_loop, name="tpusync-lease-expiry", on_failure=on_failure
        )
        self.loop.start()

    def __len__(self) -> int:
        with self._cond:
            self._expire_due()
            return len(self._held)

    def acquire(self, keys: Sequence[bytes], ttl_s: float) -> Lease:
        """Pins the present ``keys`` for ``ttl_s`` seconds (at most ``max_lifetime_s``);
        returns the lease (its ``ttl_s`` is what was granted)."""
        ttl = min(_check_ttl(ttl_s), self.max_lifetime_s)
        with self._cond:
            if self._closed:
                raise InvalidArgumentError("this LeaseTable is closed")
            self._expire_due()
            if len(self._held) >= self._max_leases:
                raise TierFullError(
                    f"{len(self._held)} leases are held (the limit is {self._max_leases}); "
                    "release leases first"
                )
            pinned = self._pool.pin(keys)  # validates the keys
            lease_id = secrets.randbits(63)
            while lease_id in self._held or lease_id == 0:
                lease_id = secrets.randbits(63)
            lease = Lease(
                lease_id,
                list(pinned.keys),
                pinned.present.tolist(),
                np.asarray(pinned.checksums, dtype=np.uint64).tolist(),
                ttl,
                np.asarray(pinned.slots, dtype=np.int64).tolist(),
            )
            now = self._clock()
            self._held[lease_id] = _Held(lease, pinned, now + ttl, now + self.max_lifetime_s)
            self._cond.notify_all()  # the expiry thread may need to wake earlier
        return lease

    def lookup(self, lease_id: int) -> Lease | None:
        """The lease if it is held and has not expired, else None."""
        with self._cond:
            self._expire_due()
            held = self._held.get(lease_id)
            return held.lease if held is not None else None

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        """Extends a held lease to ``ttl_s`` from now; False when it is unknown or expired, or
        when that would carry it past ``max_lifetime_s`` after its acquire (it then lapses at
        its last granted deadline)."""
        ttl = _check_ttl(ttl_s)
        with self._cond:
            self._expire_due()
            held = self._held.get(lease_id)
            if held is None:
                return False
            now = self._clock()
            if now + ttl > held.ends:
                self.renewals_refused += 1
                return False
            held.deadline = now + ttl
            self._cond.notify_all()
            return True

    def release(self, lease_id: int) -> bool:
        """Ends a lease and unpins its blocks. True only when the lease was held the whole time
        (it had not expired); False for an expired or unknown lease -- then the reader must
        discard what it read under it."""
        with self._cond:
            self._expire_due()
            held = self._held.pop(lease_id, None)
        if held is None:
            return False
        self._pool.unpin(held.pinned)
        return True

    def expire(self) -> int:
        """Drops the leases whose TTL has passed now; returns how many."""
        with self._cond:
            return self._expire_due()

    def _expire_due(self) -> int:
        """(Under the lock.) Unpins and forgets every lease past its deadline."""
        if not self._held:
            return 0
        now = self._clock()
        due = [lid for lid, held in self._held.items() if held.deadline <= now]
        for lease_id in due:
            held = self._held.pop(lease_id)
            self._pool.unpin(held.pinned)
        self.expired += len(due)
        return len(due)

    def _expiry_loop(self) -> None:
        with self._cond:
            while not self._closed:
                self._expire_due()
                if self._held:
                    wait = min(h.deadline for h in self._held.values()) - self._clock()
                    self._cond.wait(timeout=min(max(wait, 0.001), 60.0))
                else:
                    self._cond.wait()

    def close(self) -> None:
        """Releases every lease (unpinning its blocks) and stops the expiry thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            held = list(self._held.values())
            self._held.clear()
            self._cond.notify_all()
        self.loop.stop()
        for item in held:
            self._pool.unpin(item.pinned)
        self.loop.join(timeout=5)

    def __enter__(self) -> LeaseTable:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
