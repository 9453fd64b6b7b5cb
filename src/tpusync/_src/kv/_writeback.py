"""The KV store's write-back queue: blocks saved to DRAM wait here for a thread that writes them
into the lower tiers (see :mod:`tpusync._src.kv._tier_stack`). At most ``max_bytes`` of blocks are
queued or being written; past that a save waits (``"wait"``) or leaves its blocks to be demoted
on eviction (``"skip"``). Write-back reads DRAM slots: while it reads a block, DRAM must not
evict it (:meth:`WriteBackQueue.active`), and a block still queued when DRAM evicts it is
written down by the eviction itself (:meth:`WriteBackQueue.pending`)."""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable, Sequence

log = logging.getLogger("tpusync.kv")

__all__ = ["WriteBackQueue", "drop_one_each"]


class WriteBackQueue:
    """Keys queued for the lower tiers and the thread that writes them (``write(keys)``; none
    without a writable lower tier: then nothing is admitted). Thread-safe."""

    def __init__(
        self,
        *,
        block_bytes: int,
        max_bytes: int,
        policy: str,
        write: Callable[[list[bytes]], None] | None,
        bump: Callable[[str, int], None],
    ) -> None:
        self._block_bytes = block_bytes
        self._max = max_bytes
        self._policy = policy
        self._write = write
        self._bump = bump
        self._cond = threading.Condition(threading.Lock())
        self._queue: collections.deque[list[bytes]] = collections.deque()
        self._bytes = 0  # queued or being written
        self._busy = 0
        self._active: set[bytes] = set()  # keys whose DRAM slots write-back reads now
        self._queued: dict[bytes, int] = {}  # keys in _queue: how many times each
        self._stop = False
        self._thread: threading.Thread | None = None
        if write is not None:
            self._thread = threading.Thread(
                target=self._loop, name="tpusync-kv-writeback", daemon=True
            )
            self._thread.start()

    def admit(self, blocks: int) -> bool:
        """Takes queue room for ``blocks`` under the policy: waits for it (``"wait"``) or
        answers False (``"skip"``). False with no lower tier to write to."""
        if self._thread is None or not blocks:
            return False
        nbytes = blocks * self._block_bytes
        with self._cond:
            if self._policy == "skip":
                if self._bytes and self._bytes + nbytes > self._max:
                    self._bump("writeback_skipped", blocks)
                    return False
            else:
                while self._bytes and self._bytes + nbytes > self._max:
                    self._bump("writeback_waits", 1)
                    self._cond.wait()
            self._bytes += nbytes
            return True

    def enqueue(self, keys: list[bytes], admitted_blocks: int) -> None:
        """Queues keys for the lower tiers (room taken by :meth:`admit`)."""
        with self._cond:
            self._bytes -= (admitted_blocks - len(keys)) * self._block_bytes
            if keys:
                self._queue.append(keys)
                for key in keys:
                    self._queued[key] = self._queued.get(key, 0) + 1
            self._cond.notify_all()

    def _loop(self) -> None:
        assert self._write is not None
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                keys = self._queue.popleft()
                drop_one_each(self._queued, keys)
                self._busy += 1
                self._active.update(keys)
            try:
                self._write(keys)
            except Exception:  # never let the thread die silently; the blocks stay in DRAM
                self._bump("writeback_failed", len(keys))
                log.exception("tpusync kv: write-back failed")
            finally:
                with self._cond:
                    self._active.difference_update(keys)
                    self._busy -= 1
                    self._bytes -= len(keys) * self._block_bytes
                    self._cond.notify_all()

    def active(self) -> set[bytes]:
        """The keys whose DRAM slots write-back reads now (a copy)."""
        with self._cond:
            return set(self._active)

    def pending(self, keys: Sequence[bytes]) -> list[bytes]:
        """Those of ``keys`` queued or being written."""
        with self._cond:
            return [k for k in keys if k in self._queued or k in self._active]

    def wait_progress(self) -> None:
        """Waits a little for a write in progress to finish (no wait when none is)."""
        with self._cond:
            if self._busy:
                self._cond.wait(timeout=0.5)

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until the queue is empty; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout=timeout)

    def pending_bytes(self) -> int:
        with self._cond:
            return self._bytes

    def close(self) -> None:
        """Writes what is queued, then stops the thread."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        with self._cond:
            self._queued.clear()  # the thread drained the queue; nothing waits any more


def drop_one_each(counts: dict[bytes, int], keys: Sequence[bytes]) -> None:
    """Counts one occurrence fewer of each key; a key whose count reaches zero goes."""
    for key in keys:
        count = counts.get(key, 0) - 1
        if count > 0:
            counts[key] = count
        else:
            counts.pop(key, None)
