"""Keeps a registry told what a store's DRAM tier (or a store node) holds, under a node lease
renewed by heartbeat.

Peers pull blocks from this node's DRAM tier (its ``BlockServer``), so the registry lists the keys
DRAM holds: published when a save or a promotion commits them, withdrawn when DRAM drops them.
Registry calls run on the link's own thread, in order, never on a save's or an eviction's path;
a registry that is down never fails a save or a load: the link logs and retries at the next
heartbeat (not before, however many changes queue up meanwhile), and re-registers and
re-publishes everything when the registry no longer lists the node -- a heartbeat answered False
or a publish refused, as when its lease lapsed or the registry restarted empty (and as after this
process restarts, when the store publishes what its /dev/shm tier still holds). Anything else
the registry's client raises on that thread is a bug: the loop is restarted
(:mod:`tpusync._src.cluster.supervisor`), and given up on (``on_failure``) if it keeps dying.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence

from tpusync._src.cluster.registry.base import NodeInfo, Registry, longest_common_prefix
from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync.errors import InvalidArgumentError, TpuSyncError

__all__ = ["RegistryLink"]

log = logging.getLogger("tpusync.kv")

_BATCH = 4096  # keys per registry call


class RegistryLink:
    """Publishes a store's DRAM keys to ``registry`` as node ``node`` (see the module docstring).

    Args:
      registry: any :class:`tpusync.cluster.Registry`.
      node: this node (its ``addresses`` are where its BlockServer listens).
      ttl_s: the node lease; the heartbeat renews it every third of it.
      current_keys: returns the keys DRAM holds now (published at start and after a lapse).
      on_failure: called with its last exception if the link's thread keeps dying and is
        given up on (the node then drops out of the registry when its lease lapses).
    """

    def __init__(
        self,
        registry: Registry,
        node: NodeInfo,
        ttl_s: float,
        current_keys: Callable[[], list[bytes]],
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.registry = registry
        self.node = node
        self.ttl_s = float(ttl_s)
        self._current_keys = current_keys
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lapsed = threading.Event()  # the registry does not list this node (any more)
        self._lock = threading.Lock()
        self._sending = threading.Lock()
        # Changes wait here for the link's thread: registry calls never run on a save's or an
        # eviction's path (a slow or absent registry must not slow the store).
        self._changes: collections.deque[tuple[str, list[bytes]]] = collections.deque()
        self._register_all()
        self.loop = SupervisedLoop(self._run, name="tpusync-kv-registry", on_failure=on_failure)
        self.loop.start()

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def _register_all(self) -> None:
        self.registry.register(self.node, self.ttl_s)
        self._send("publish", self._current_keys())

    def _send(self, method: str, keys: list[bytes]) -> None:
        call = getattr(self.registry, method)
        for i in range(0, len(keys), _BATCH):
            if method == "publish":
                call(self.node_id, keys[i : i + _BATCH], "dram")
            else:
                call(self.node_id, keys[i : i + _BATCH])

    def _run(self) -> None:
        next_beat = time.monotonic() + self.ttl_s / 3
        failed = False  # the last attempt failed: nothing is retried before the next beat
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            beat = time.monotonic() >= next_beat
            if failed and not beat:
                continue  # a new change does not make a failing registry worth a retry
            if beat:
                next_beat = time.monotonic() + self.ttl_s / 3
            try:
                if beat and not self.registry.heartbeat(self.node_id, self.ttl_s):
                    self._lapsed.set()
                if not self._lapsed.is_set():
                    try:
                        self.flush_changes()
                    except InvalidArgumentError:
                        if not self._lapsed.is_set():
                            raise
                if self._lapsed.is_set():
                    self._register_again()
                failed = False
            except (TpuSyncError, OSError) as error:  # retried at the next beat
                failed = True
                log.warning("tpusync kv: registry update failed: %s", error)

    def _register_again(self) -> None:
        """The registry lost this node (its lease lapsed, or the registry restarted empty):
        registers it again and publishes everything DRAM holds now, which supersedes every
        queued change (no sender runs meanwhile, so none of them is lost or sent twice)."""
        log.warning("tpusync kv: registry lease lapsed; registering %s again", self.node_id)
        with self._sending:
            with self._lock:
                self._changes.clear()
            self._register_all()
            self._lapsed.clear()

    def flush_changes(self) -> None:
        """Sends the queued publishes and withdrawals, in order (one sender at a time)."""
        with self._sending:
            while True:
                with self._lock:
                    if not self._changes:
                        return
                    method, keys = self._changes[0]
                try:
                    self._send(method, keys)
                except InvalidArgumentError:
                    # Every backend refuses a publish for a node it does not list (lapsed or
                    # forgotten by a restarted registry): the link's thread registers again.
                    if method == "publish":
                        self._lapsed.set()
                        self._wake.set()
                    raise
                with self._lock:
                    self._changes.popleft()

    def common_prefix(self, keys_per_shard: Sequence[Sequence[bytes]]) -> int:
        """The longest prefix the registry lists for every shard's keys (tensor parallelism:
        how a store asks whether the other shards hold a block too)."""
        return longest_common_prefix(self.registry, keys_per_shard)

    def added(self, keys: Sequence[bytes]) -> None:
        self._queue("publish", keys)

    def removed(self, keys: Sequence[bytes]) -> None:
        self._queue("withdraw", keys)

    def _queue(self, method: str, keys: Sequence[bytes]) -> None:
        if keys and not self._stop.is_set():
            with self._lock:
                self._changes.append((method, list(keys)))
            self._wake.set()

    def close(self) -> None:
        """Stops the heartbeat and removes the node (and its entries) from the registry."""
        self._stop.set()
        self.loop.stop()
        self._wake.set()
        self.loop.join(timeout=5)
        try:
            self.registry.unregister(self.node_id)
        except (TpuSyncError, OSError) as error:
            log.warning("tpusync kv: registry unregister failed: %s", error)
