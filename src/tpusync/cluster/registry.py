"""The registry: which live node holds which KV block, for cross-host prefix lookups.

One protocol (:class:`Registry`), several backends: :class:`MemoryRegistry` (embedded, the
default; other processes reach it over TCP through a registry server), Redis/Valkey for fleets,
and the coordination service of a multi-controller JAX job.

Liveness is per node, not per block: a node registers with a TTL and renews it by heartbeat;
when the lease lapses its entries stop counting at once (lookups ignore them) and are removed
later by a sweep. Owners publish keys after a save completes and withdraw them on eviction; a
restarted node re-publishes what its /dev/shm and disk tiers still hold.

With tensor parallelism every shard of a model is a node of the same ``group`` with its own
``shard_rank``; each shard stores its own part of every block, under its own keys (the namespace
covers the shard). A lookup for a group asks for the keys of every shard and counts a block only
where all shards have it (:func:`longest_common_prefix`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tpusync.errors import InvalidArgumentError

__all__ = [
    "Holder",
    "MemoryRegistry",
    "NodeInfo",
    "Registry",
    "longest_common_prefix",
    "longest_prefix",
]

MAX_KEY_BYTES = 32
MAX_TIER_CHARS = 64


@dataclass(frozen=True)
class NodeInfo:
    """A node that serves blocks: its id, the data-plane addresses peers connect to
    (``"host:port"``, one per path), and its tensor-parallel place."""

    node_id: str
    addresses: tuple[str, ...] = ()
    group: str = ""
    shard_rank: int = 0
    shard_count: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not 1 <= len(self.node_id) <= 128:
            raise InvalidArgumentError(
                f"node_id: expected a string of 1 to 128 characters, got {self.node_id!r}"
            )


@dataclass(frozen=True, order=True)
class Holder:
    """One live node holding a block, and in which of its tiers."""

    node_id: str
    tier: str = field(compare=False)


@runtime_checkable
class Registry(Protocol):
    """What every registry backend offers. All calls are thread-safe; keys are bytes of 1 to
    32 bytes (the store's block keys)."""

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        """Adds or refreshes a node; its entries count until ``ttl_s`` passes without a
        :meth:`heartbeat`."""
        ...

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        """Extends a node's lease; False when the node is unknown or its lease lapsed (it must
        :meth:`register` again and re-publish)."""
        ...

    def unregister(self, node_id: str) -> None:
        """Removes a node and all its entries."""
        ...

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        """Records that ``node_id`` holds ``keys`` in ``tier``."""
        ...

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        """Records that ``node_id`` no longer holds ``keys``."""
        ...

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        """For each key, the live nodes holding it (sorted by node id)."""
        ...

    def nodes(self) -> list[NodeInfo]:
        """The live nodes."""
        ...

    def close(self) -> None: ...


def check_keys(keys: Sequence[bytes], argument: str = "keys") -> list[bytes]:
    out = []
    for i, key in enumerate(keys):
        if type(key) is not bytes or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"{argument}[{i}]: expected 1 to {MAX_KEY_BYTES} bytes, got {key!r}"
            )
        out.append(key)
    return out


def check_ttl(ttl_s: float) -> float:
    if not isinstance(ttl_s, int | float) or isinstance(ttl_s, bool) or not 0 < ttl_s <= 86400:
        raise InvalidArgumentError(f"ttl_s: expected seconds in (0, 86400], got {ttl_s!r}")
    return float(ttl_s)


def check_tier(tier: str) -> str:
    if not isinstance(tier, str) or not 1 <= len(tier) <= MAX_TIER_CHARS:
        raise InvalidArgumentError(
            f"tier: expected a tier name of 1 to {MAX_TIER_CHARS} characters, got {tier!r}"
        )
    return tier


def longest_prefix(
    registry: Registry, keys: Sequence[bytes], *, exclude: str | None = None
) -> tuple[int, list[list[Holder]]]:
    """The longest prefix of ``keys`` that some live node (other than ``exclude``) holds, and
    the holders of each of its blocks."""
    found = registry.holders(keys)
    out = []
    for holders in found:
        holders = [h for h in holders if h.node_id != exclude]
        if not holders:
            break
        out.append(holders)
    return len(out), out


def longest_common_prefix(registry: Registry, keys_per_shard: Sequence[Sequence[bytes]]) -> int:
    """The longest prefix every shard's keys are held for (tensor parallelism: a block counts
    only where all shards have it)."""
    n = min((len(k) for k in keys_per_shard), default=0)
    for keys in keys_per_shard:
        count, _ = longest_prefix(registry, list(keys)[:n])
        n = min(n, count)
    return n


class MemoryRegistry:
    """The embedded backend: a registry in this process's memory (serve it to other processes
    with a registry server).

    Args:
      clock: seconds, monotonic (tests may pass their own).
    """

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}  # node id -> (info, expiry)
        self._entries: dict[bytes, dict[str, str]] = {}  # key -> node id -> tier
        self._by_node: dict[str, set[bytes]] = {}
        self._closed = False

    def _alive(self, node_id: str, now: float) -> bool:
        entry = self._nodes.get(node_id)
        return entry is not None and entry[1] > now

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        if not isinstance(node, NodeInfo):
            raise InvalidArgumentError(f"node: expected a NodeInfo, got {type(node).__name__}")
        ttl = check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            old = self._nodes.get(node.node_id)
            if old is not None and old[1] <= now:  # it lapsed: its old entries are void
                self._drop_entries(node.node_id)
            self._nodes[node.node_id] = (node, now + ttl)
            self._by_node.setdefault(node.node_id, set())

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        ttl = check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            if not self._alive(node_id, now):
                return False
            info, _ = self._nodes[node_id]
            self._nodes[node_id] = (info, now + ttl)
            return True

    def unregister(self, node_id: str) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)
            self._drop_entries(node_id)

    def _drop_entries(self, node_id: str) -> None:
        for key in self._by_node.pop(node_id, set()):
            held = self._entries.get(key)
            if held is not None:
                held.pop(node_id, None)
                if not held:
                    del self._entries[key]

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        keys = check_keys(keys)
        check_tier(tier)
        with self._lock:
            if not self._alive(node_id, self._clock()):
                raise InvalidArgumentError(
                    f"node_id: {node_id!r} is not registered or its lease lapsed; register it first"
                )
            mine = self._by_node[node_id]
            for key in keys:
                self._entries.setdefault(key, {})[node_id] = tier
                mine.add(key)

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        with self._lock:
            mine = self._by_node.get(node_id, set())
            for key in keys:
                held = self._entries.get(key)
                if held is not None and held.pop(node_id, None) is not None and not held:
                    del self._entries[key]
                mine.discard(key)

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        with self._lock:
            now = self._clock()
            out = []
            for key in keys:
                held = self._entries.get(key, {})
                out.append(sorted(Holder(n, t) for n, t in held.items() if self._alive(n, now)))
            return out

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            now = self._clock()
            return [info for info, expiry in self._nodes.values() if expiry > now]

    def sweep(self) -> int:
        """Removes lapsed nodes and their entries; returns the nodes removed."""
        with self._lock:
            now = self._clock()
            dead = [n for n, (_, expiry) in self._nodes.items() if expiry <= now]
            for node_id in dead:
                del self._nodes[node_id]
                self._drop_entries(node_id)
            return len(dead)

    def close(self) -> None:
        self._closed = True
