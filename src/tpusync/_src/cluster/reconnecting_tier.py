"""A lower tier over a peer that could not be reached when the store opened
(:class:`ReconnectingTier`): the store starts degraded, not dead.

A store node or peer that is down (or restarting) while an engine starts would otherwise fail
the engine's start, although the same peer going down later is only a miss. Instead the tier
opens empty-handed: every call fails at once with :class:`~tpusync.errors.PeerUnavailableError`
(the store rests the tier and counts a miss, as for a peer gone later), while a thread of its
own opens the real tier again with back-off; from the first success every call goes to the
real tier. A peer that answers but is refused (a wrong secret, not a store node) is a
configuration error: it is logged and not retried."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import PeerUnavailableError, TpuSyncError

__all__ = ["ReconnectingTier"]

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.5
RETRY_LONGEST_S = 30.0


class ReconnectingTier:
    """A lower tier that opens ``open_tier()`` in the background (see the module docstring).

    Args:
      open_tier: opens the real tier (raises ``PeerUnavailableError`` while the peer cannot be
        reached).
      layout: the store's block layout.
      label: names the peer in logs and errors.
      read_only: whether the real tier is only read.
      retry_first_s, retry_longest_s: the first pause between attempts, doubling up to the
        longest.
    """

    def __init__(
        self,
        open_tier: Callable[[], Any],
        *,
        layout: PoolLayout,
        label: str,
        read_only: bool,
        retry_first_s: float = RETRY_FIRST_S,
        retry_longest_s: float = RETRY_LONGEST_S,
    ) -> None:
        self.layout = layout
        self.label = label
        self.read_only = read_only
        self.stats = TierStats(label)
        self.failure: BaseException | None = None  # a refusal that ends the retries
        self._open_tier = open_tier
        self._tier: Any = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._first_s, self._longest_s = retry_first_s, retry_longest_s
        self._thread = threading.Thread(
            target=self._reconnect, name=f"tpusync-reconnect-{label}", daemon=True
        )
        self._thread.start()

    @property
    def connected(self) -> bool:
        """Whether the real tier is open."""
        return self._tier is not None

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Waits up to ``timeout`` seconds for the real tier; returns :attr:`connected`."""
        self._thread.join(timeout)
        return self.connected

    def _reconnect(self) -> None:
        pause = self._first_s
        while not self._closed.wait(pause):
            try:
                tier = self._open_tier()
            except PeerUnavailableError as error:
                log.debug("tpusync: %s still unreachable: %s", self.label, error)
                pause = min(pause * 2, self._longest_s)
                continue
            except (TpuSyncError, OSError) as error:  # it answered, and refused us
                self.failure = error
                log.error("tpusync: %s refused this store; not retried: %s", self.label, error)
                return
            with self._lock:
                if self._closed.is_set():
                    tier.close()
                    return
                self._tier = tier
                self.stats = tier.stats
            log.warning("tpusync: %s is reachable now; the tier serves", self.label)
            return

    def _real(self) -> Any:
        tier = self._tier
        if tier is None:
            why = f" ({self.failure})" if self.failure is not None else ""
            raise PeerUnavailableError(
                f"{self.label}: not reached since the store opened{why}; a miss until it is"
            )
        return tier

    @property
    def capacity(self) -> int:
        return int(self._real().capacity)

    @property
    def used(self) -> int:
        return int(self._real().used)

    @property
    def free(self) -> int:
        tier = self._real()
        free = getattr(tier, "free", None)
        return int(free) if free is not None else int(tier.capacity) - int(tier.used)

    def put(self, keys: Sequence[bytes], source: Any) -> int:
        return int(self._real().put(keys, source))

    def get(self, keys: Sequence[bytes], target: Any) -> None:
        self._real().get(keys, target)

    def get_scattered(self, keys: Sequence[bytes], scatter: Any) -> list[bool]:
        return list(self._real().get_scattered(keys, scatter))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return list(self._real().contains(keys))

    def delete(self, keys: Sequence[bytes]) -> int:
        return int(self._real().delete(keys))

    def keys(self) -> list[bytes]:
        return list(self._real().keys())

    def close(self) -> None:
        """Stops the retries and closes the real tier if it opened."""
        with self._lock:
            self._closed.set()
            tier, self._tier = self._tier, None
        if tier is not None:
            tier.close()
        self._thread.join(timeout=5)
