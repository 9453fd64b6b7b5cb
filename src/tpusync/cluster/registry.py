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

import bisect
import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Protocol, runtime_checkable

from tpusync.errors import InvalidArgumentError

__all__ = [
    "Holder",
    "MemoryRegistry",
    "NodeInfo",
    "PrefixRegistry",
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


@runtime_checkable
class PrefixRegistry(Registry, Protocol):
    """A registry with the optional fast prefix lookup :meth:`prefix_holders`, which
    :func:`longest_prefix` uses where a backend has it (one call that stops at the first key
    nobody holds, instead of :meth:`~Registry.holders` for every key)."""

    def prefix_holders(
        self, keys: Sequence[bytes], *, exclude: str | None = None
    ) -> list[list[Holder]]:
        """The holders of the longest prefix of ``keys`` that some live node other than
        ``exclude`` holds: one list per key of that prefix (the live holders other than
        ``exclude``, sorted by node id, never empty). Every key is checked, even past the
        prefix."""
        ...


def check_keys(keys: Sequence[bytes], argument: str = "keys") -> list[bytes]:
    out = list(keys)
    # the common case at C speed: all bytes (not a subclass) of an allowed length
    if not out or (
        set(map(type, out)) == {bytes}
        and min(map(len, out)) >= 1
        and max(map(len, out)) <= MAX_KEY_BYTES
    ):
        return out
    for i, key in enumerate(out):
        if type(key) is not bytes or not 1 <= len(key) <= MAX_KEY_BYTES:
            raise InvalidArgumentError(
                f"{argument}[{i}]: expected 1 to {MAX_KEY_BYTES} bytes, got {key!r}"
            )
    return out  # pragma: no cover - a key failed the fast check, so one fails here


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


def check_exclude(exclude: str | None) -> str | None:
    if exclude is not None and not isinstance(exclude, str):
        raise InvalidArgumentError(f"exclude: expected a node id or None, got {exclude!r:.100}")
    return exclude


def longest_prefix(
    registry: Registry, keys: Sequence[bytes], *, exclude: str | None = None
) -> tuple[int, list[list[Holder]]]:
    """The longest prefix of ``keys`` that some live node (other than ``exclude``) holds, and
    the holders of each of its blocks.

    Uses the backend's :meth:`PrefixRegistry.prefix_holders` where it has one (it stops at the
    first key nobody holds), else :meth:`Registry.holders` of every key."""
    check_exclude(exclude)
    fast = getattr(registry, "prefix_holders", None)
    if fast is not None:
        found = fast(keys, exclude=exclude)
        return len(found), found
    return prefix_of(registry.holders(keys), exclude)


def prefix_of(
    found: Sequence[list[Holder]], exclude: str | None = None
) -> tuple[int, list[list[Holder]]]:
    """The leading entries of a :meth:`Registry.holders` answer that have a holder other than
    ``exclude`` (without ``exclude``): :func:`longest_prefix` from a full answer."""
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
        if n == 0:
            break
        count, _ = longest_prefix(registry, list(keys)[:n])
        n = min(n, count)
    return n


class MemoryRegistry:
    """The embedded backend: a registry in this process's memory (serve it to other processes
    with a registry server).

    Lookups are cheap: each key maps to a tuple of its holders kept sorted by node id as they
    are published (one shared :class:`Holder` per node and tier), and which nodes have lapsed
    is worked out once and reused until the next lease can lapse or a node changes.

    Args:
      clock: seconds, monotonic (tests may pass their own).
    """

    def __init__(self, *, clock: Callable[[], float] | None = None) -> None:
        self._clock = clock or time.monotonic
        self._lock = threading.Lock()
        self._nodes: dict[str, tuple[NodeInfo, float]] = {}  # node id -> (info, expiry)
        # key -> its holders sorted by node id, lapsed ones too until a sweep (never empty)
        self._entries: dict[bytes, tuple[Holder, ...]] = {}
        self._by_node: dict[str, set[bytes]] = {}
        self._holder_objs: dict[str, dict[str, Holder]] = {}  # node id -> tier -> Holder
        # the known nodes whose lease has lapsed, as of any time in [_dead_from, _dead_until)
        self._dead: frozenset[str] = frozenset()
        self._dead_from = math.inf
        self._dead_until = -math.inf
        self._closed = False

    def _alive(self, node_id: str, now: float) -> bool:
        entry = self._nodes.get(node_id)
        return entry is not None and entry[1] > now

    def _lapsed(self, now: float) -> frozenset[str]:
        """The known nodes whose lease has lapsed at ``now`` (under the lock)."""
        if self._dead_from <= now < self._dead_until:
            return self._dead
        dead = []
        until = math.inf  # the next lease to lapse
        for node_id, (_, expiry) in self._nodes.items():
            if expiry <= now:
                dead.append(node_id)
            elif expiry < until:
                until = expiry
        self._dead = frozenset(dead)
        self._dead_from, self._dead_until = now, until
        return self._dead

    def _nodes_changed(self) -> None:
        self._dead_until = -math.inf

    def _holder(self, node_id: str, tier: str) -> Holder:
        tiers = self._holder_objs.setdefault(node_id, {})
        holder = tiers.get(tier)
        if holder is None:
            holder = tiers[tier] = Holder(node_id, tier)
        return holder

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
            self._nodes_changed()

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        ttl = check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            if not self._alive(node_id, now):
                return False
            info, _ = self._nodes[node_id]
            self._nodes[node_id] = (info, now + ttl)
            # a live node stays live; its lease may now end sooner than the cache assumed
            self._dead_until = min(self._dead_until, now + ttl)
            return True

    def unregister(self, node_id: str) -> None:
        with self._lock:
            self._nodes.pop(node_id, None)
            self._drop_entries(node_id)
            self._nodes_changed()

    def _drop_entries(self, node_id: str) -> None:
        self._holder_objs.pop(node_id, None)
        entries = self._entries
        for key in self._by_node.pop(node_id, ()):
            held = entries.get(key)
            if held is not None:
                rest = tuple(h for h in held if h.node_id != node_id)
                if rest:
                    entries[key] = rest
                else:
                    del entries[key]

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        keys = check_keys(keys)
        check_tier(tier)
        with self._lock:
            if not self._alive(node_id, self._clock()):
                raise InvalidArgumentError(
                    f"node_id: {node_id!r} is not registered or its lease lapsed; register it first"
                )
            holder = self._holder(node_id, tier)
            only = (holder,)
            entries = self._entries
            for key in keys:
                held = entries.get(key)
                if held is None or (len(held) == 1 and held[0].node_id == node_id):
                    entries[key] = only
                else:
                    entries[key] = _with_holder(held, holder)
            self._by_node[node_id].update(keys)

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        with self._lock:
            mine = self._by_node.get(node_id)
            entries = self._entries
            for key in keys:
                held = entries.get(key)
                if held is not None:
                    rest = tuple(h for h in held if h.node_id != node_id)
                    if not rest:
                        del entries[key]
                    elif len(rest) != len(held):
                        entries[key] = rest
            if mine:
                mine.difference_update(keys)

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        with self._lock:
            dead = self._lapsed(self._clock())
            found = map(self._entries.get, keys, repeat((), len(keys)))
            if not dead:
                return list(map(list, found))
            return [[h for h in held if h.node_id not in dead] for held in found]

    def prefix_holders(
        self, keys: Sequence[bytes], *, exclude: str | None = None
    ) -> list[list[Holder]]:
        """See :meth:`PrefixRegistry.prefix_holders`: stops at the first key no live node
        other than ``exclude`` holds."""
        keys = check_keys(keys)
        check_exclude(exclude)
        with self._lock:
            skip = self._lapsed(self._clock())
            if exclude is not None:
                skip = skip | {exclude}
            if not skip:  # no filtering: the prefix ends at the first key nobody holds
                found = list(map(self._entries.get, keys))
                with contextlib.suppress(ValueError):
                    del found[found.index(None) :]
                return list(map(list, found))
            get = self._entries.get
            out = []
            for key in keys:
                held = [h for h in get(key, ()) if h.node_id not in skip]
                if not held:
                    break
                out.append(held)
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
            self._nodes_changed()
            return len(dead)

    def close(self) -> None:
        self._closed = True


def _node_id(holder: Holder) -> str:
    return holder.node_id


def _with_holder(held: tuple[Holder, ...], holder: Holder) -> tuple[Holder, ...]:
    """``held`` (sorted by node id) with ``holder`` in its place, replacing the same node's."""
    i = bisect.bisect_left(held, holder.node_id, key=_node_id)
    end = i + 1 if i < len(held) and held[i].node_id == holder.node_id else i
    return (*held[:i], holder, *held[end:])
