"""The embedded registry backend: :class:`MemoryRegistry`, a registry in this process's memory
(serve it to other processes with :class:`~tpusync.cluster.RegistryServer`)."""

from __future__ import annotations

import bisect
import contextlib
import math
import threading
import time
from collections.abc import Callable, Sequence
from itertools import repeat

from tpusync._src.cluster.registry._leases import (
    has_lapsed,
    lapsed_nodes,
    lease_end,
    not_live_message,
)
from tpusync._src.cluster.registry.base import (
    Holder,
    NodeInfo,
    check_exclude,
    check_keys,
    check_tier,
    check_ttl,
)
from tpusync.errors import InvalidArgumentError

__all__ = ["MemoryRegistry"]


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
        return not has_lapsed(None if entry is None else entry[1], now)

    def _lapsed(self, now: float) -> frozenset[str]:
        """The known nodes whose lease has lapsed at ``now`` (under the lock)."""
        if self._dead_from <= now < self._dead_until:
            return self._dead
        dead = []
        until = math.inf  # the next lease to lapse
        for node_id, (_, expiry) in self._nodes.items():
            if has_lapsed(expiry, now):
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
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            old = self._nodes.get(node.node_id)
            if old is not None and has_lapsed(old[1], now):  # it lapsed: its old entries are void
                self._drop_entries(node.node_id)
            self._nodes[node.node_id] = (node, lease_end(ttl_s, now))
            self._by_node.setdefault(node.node_id, set())
            self._nodes_changed()

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            if not self._alive(node_id, now):
                return False
            info, _ = self._nodes[node_id]
            end = lease_end(ttl_s, now)
            self._nodes[node_id] = (info, end)
            # a live node stays live; its lease may now end sooner than the cache assumed
            self._dead_until = min(self._dead_until, end)
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
                raise InvalidArgumentError(not_live_message(node_id))
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
            return [info for info, expiry in self._nodes.values() if not has_lapsed(expiry, now)]

    def sweep(self) -> int:
        """Removes lapsed nodes and their entries; returns the nodes removed."""
        with self._lock:
            now = self._clock()
            dead = lapsed_nodes(((n, e) for n, (_, e) in self._nodes.items()), now)
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
