"""The registry protocol: which live node holds which KV block, for cross-host prefix lookups.

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

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tpusync.errors import InvalidArgumentError, RegistryUnavailableError

__all__ = [
    "Holder",
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


def batched(items: Sequence[Any], size: int, *, at_least_one: bool = False) -> Iterator[Any]:
    """``items`` in slices of ``size`` (a backend's request or script-call limit); with
    ``at_least_one``, one empty slice when there are no items (a call that must happen)."""
    for i in range(0, max(len(items), 1 if at_least_one else 0), size):
        yield items[i : i + size]


def check_answer(found: list[Any], asked: int, answer: Any, what: str) -> list[Any]:
    """Refuses a backend's answer that does not hold one entry per key asked."""
    if len(found) != asked:
        raise RegistryUnavailableError(f"malformed {what} answer: {answer!r:.200}")
    return found


def check_keys(keys: Sequence[bytes], argument: str = "keys") -> list[bytes]:
    out = list(keys)
    # the common case at C speed: all bytes (not a subclass) of an allowed length
    if not out:
        return out
    if set(map(type, out)) == {bytes}:
        lengths = set(map(len, out))  # one pass; min and max then run over a few sizes
        if min(lengths) >= 1 and max(lengths) <= MAX_KEY_BYTES:
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


# -- node records, as every wire format and backend carries them ---------------------------------


def check_node(node: NodeInfo) -> NodeInfo:
    """A NodeInfo whose fields all have the types the wire formats carry."""
    if not isinstance(node, NodeInfo):
        raise InvalidArgumentError(f"node: expected a NodeInfo, got {type(node).__name__}")
    if not isinstance(node.addresses, tuple | list) or not all(
        isinstance(a, str) for a in node.addresses
    ):
        raise InvalidArgumentError(
            f"node.addresses: expected a tuple of 'host:port' strings, got {node.addresses!r}"
        )
    if not isinstance(node.group, str):
        raise InvalidArgumentError(f"node.group: expected a string, got {node.group!r}")
    for name in ("shard_rank", "shard_count"):
        value = getattr(node, name)
        if type(value) is not int or value < (0 if name == "shard_rank" else 1):
            raise InvalidArgumentError(
                f"node.{name}: expected an integer >= {0 if name == 'shard_rank' else 1}, "
                f"got {value!r}"
            )
    return node


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not 1 <= len(node_id) <= 128:
        raise InvalidArgumentError(
            f"node_id: expected a string of 1 to 128 characters, got {node_id!r}"
        )
    return node_id


def node_to_dict(node: NodeInfo) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "addresses": list(node.addresses),
        "group": node.group,
        "shard_rank": node.shard_rank,
        "shard_count": node.shard_count,
    }


def node_from_dict(data: Any, argument: str = "node") -> NodeInfo:
    """The NodeInfo of :func:`node_to_dict`'s output, every field type-checked."""
    if not isinstance(data, dict) or not isinstance(data.get("node_id"), str):
        raise InvalidArgumentError(f"{argument}: expected a node record, got {data!r:.200}")
    unknown = set(data) - {"node_id", "addresses", "group", "shard_rank", "shard_count"}
    if unknown:
        raise InvalidArgumentError(f"{argument}: unknown fields {sorted(unknown)}")
    addresses = data.get("addresses", [])
    if not isinstance(addresses, list):
        raise InvalidArgumentError(f"{argument}.addresses: expected a list, got {addresses!r}")
    node = NodeInfo(
        node_id=data["node_id"],
        addresses=tuple(addresses),
        group=data.get("group", ""),
        shard_rank=data.get("shard_rank", 0),
        shard_count=data.get("shard_count", 1),
    )
    return check_node(node)
