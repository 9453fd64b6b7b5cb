"""A circuit per peer address: a client stops asking a peer that keeps failing.

One dead or stalled peer must not cost every request a timeout (the class of TPU Sync's issue
#888, where one dead peer starved every handshake). So each client keeps, per peer address, a
circuit with three states:

- **closed** (the peer works): requests go through; failures are counted.
- **open**: after ``threshold`` consecutive failures, or at once after a missed deadline (a
  timeout says the peer is stalled, and the next request would wait it out again). While open,
  :meth:`PeerCircuits.admit` raises :class:`CircuitOpenError` without touching the network, and
  callers count the request as a miss.
- **half-open**: once the back-off is over (``first_backoff_s``, doubling with each opening in a
  row, at most ``longest_backoff_s``), one request is let through as a probe (the others still
  fail at once); its success closes the circuit, its failure opens it again for longer.

Thread-safe; no thread of its own. The KV store's own per-tier rest (``kv/_tier_faults.py``)
sits above this: it rests a whole tier, while a circuit rests one peer among the several that
serve a tier (:class:`~tpusync.cluster.RegistryPool`), and bounds the retries inside one tier
operation (a store node's get in several leases).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from tpusync.errors import CircuitOpenError, InvalidArgumentError

__all__ = ["PeerCircuits", "is_deadline_miss"]

DEFAULT_THRESHOLD = 3
DEFAULT_FIRST_BACKOFF_S = 1.0
DEFAULT_LONGEST_BACKOFF_S = 60.0


def is_deadline_miss(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) is a timeout: the peer is stalled."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, TimeoutError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


@dataclass
class _Circuit:
    failures: int = 0  # consecutive
    backoff_s: float = 0.0  # the last opening's back-off; 0: closed
    open_until: float = 0.0
    probing: bool = False  # a half-open probe is in flight


class PeerCircuits:
    """The circuits of one client's peers, by address (see the module docstring).

    Args:
      threshold: consecutive failures that open a circuit (a missed deadline opens it at once).
      first_backoff_s: how long a circuit stays open the first time; it doubles with each
        opening in a row, up to ``longest_backoff_s``.
      clock: monotonic seconds (tests pass their own, to end a back-off without waiting).
    """

    def __init__(
        self,
        *,
        threshold: int = DEFAULT_THRESHOLD,
        first_backoff_s: float = DEFAULT_FIRST_BACKOFF_S,
        longest_backoff_s: float = DEFAULT_LONGEST_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if type(threshold) is not int or threshold < 1:
            raise InvalidArgumentError(f"threshold: expected an int >= 1, got {threshold!r}")
        for name, value in (
            ("first_backoff_s", first_backoff_s),
            ("longest_backoff_s", longest_backoff_s),
        ):
            if not isinstance(value, int | float) or not value > 0:
                raise InvalidArgumentError(f"{name}: expected seconds > 0, got {value!r}")
        if longest_backoff_s < first_backoff_s:
            raise InvalidArgumentError(
                f"longest_backoff_s: expected at least first_backoff_s ({first_backoff_s}), "
                f"got {longest_backoff_s}"
            )
        self._clock = clock
        self.threshold = threshold
        self.first_backoff_s = float(first_backoff_s)
        self.longest_backoff_s = float(longest_backoff_s)
        self._lock = threading.Lock()
        self._peers: dict[str, _Circuit] = {}
        self.skipped = 0  # requests failed at once because a circuit was open

    def available(self, address: str) -> bool:
        """Whether a request to ``address`` would be let through now (closed, or due for its
        half-open probe and no probe in flight); takes nothing (for choosing among holders)."""
        with self._lock:
            circuit = self._peers.get(address)
            if circuit is None or not circuit.backoff_s:
                return True
            return not circuit.probing and self._clock() >= circuit.open_until

    def state(self, address: str) -> str:
        """``"closed"``, ``"open"`` or ``"half-open"`` (its back-off is over)."""
        with self._lock:
            circuit = self._peers.get(address)
            if circuit is None or not circuit.backoff_s:
                return "closed"
            return "open" if self._clock() < circuit.open_until else "half-open"

    def admit(self, address: str) -> None:
        """Lets a request to ``address`` through, or raises :class:`CircuitOpenError` (naming
        the peer and when it is asked again) while its circuit is open or another request is
        its half-open probe. Follow with :meth:`succeeded` or :meth:`failed`."""
        with self._lock:
            circuit = self._peers.get(address)
            if circuit is None or not circuit.backoff_s:
                return
            now = self._clock()
            if now >= circuit.open_until and not circuit.probing:
                circuit.probing = True  # this request is the probe
                return
            self.skipped += 1
            left = max(0.0, circuit.open_until - now)
        raise CircuitOpenError(
            f"{address}: not asked, it failed recently (its circuit is open; a probe goes "
            f"out in {left:.1f} s, or is in flight)"
        )

    def succeeded(self, address: str) -> None:
        """Notes that ``address`` answered: closes its circuit."""
        with self._lock:
            circuit = self._peers.get(address)
            if circuit is not None:
                del self._peers[address]

    def failed(self, address: str, error: BaseException | None = None) -> None:
        """Notes a failure of ``address`` (``error``: what it raised; a timeout opens the
        circuit at once)."""
        with self._lock:
            circuit = self._peers.setdefault(address, _Circuit())
            circuit.failures += 1
            was_open = bool(circuit.backoff_s)
            if not (was_open or is_deadline_miss(error) or circuit.failures >= self.threshold):
                return
            circuit.probing = False
            circuit.backoff_s = (
                min(circuit.backoff_s * 2, self.longest_backoff_s)
                if was_open
                else self.first_backoff_s
            )
            circuit.open_until = self._clock() + circuit.backoff_s

    def release(self, address: str) -> None:
        """Ends a probe that neither succeeded nor failed (e.g. the request was refused before
        it reached the network), so that another request may probe."""
        with self._lock:
            circuit = self._peers.get(address)
            if circuit is not None:
                circuit.probing = False

    def open_peers(self) -> list[str]:
        """The addresses whose circuit is open or half-open."""
        with self._lock:
            return sorted(a for a, c in self._peers.items() if c.backoff_s)
