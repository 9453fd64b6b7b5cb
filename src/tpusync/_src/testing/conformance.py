"""Conformance suites a tier author (or a registry backend's) runs against their own
implementation: the behaviour every :class:`~tpusync.tiers.LowerTier` and every
:class:`~tpusync.cluster.Registry` must show for the KV store to rely on it.

Two ways to run them:

* functions: ``check_tier(open_tier)`` runs every tier case, ``check_registry(make_registry)``
  every registry case; each case is also a function of its own (``TIER_CASES``,
  ``REGISTRY_CASES``), to call one at a time.
* pytest: subclass :class:`TierConformance` (or :class:`RegistryConformance`) in a class named
  ``Test...`` and define ``open_tier(self, layout)`` (``make_registry(self)``); pytest then
  collects one test per case.

``open_tier(layout)`` returns a fresh, empty, writable tier for blocks of ``layout``;
``make_registry()`` a fresh, empty registry. The suite closes what they return. Block payloads
are random bytes (a seeded generator: ``seed=``), never zeros.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tpusync._src.cluster.registry import NodeInfo
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import ArrayLayout, PoolLayout
from tpusync.errors import BlocksMissingError, TierFullError

OpenTier = Callable[[PoolLayout], Any]
MakeRegistry = Callable[[], Any]


def conformance_layout(model_id: str = "conformance") -> PoolLayout:
    """The block layout of the tier cases: two arrays of 8 KiB per block."""
    arrays = tuple(ArrayLayout(n, "uint16", (8, 512), 0, 1) for n in ("k", "v"))
    return PoolLayout(model_id, arrays)


def _key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


class _Blocks:
    """Random payloads per key, and DRAM pools to move them through."""

    def __init__(self, layout: PoolLayout, seed: int) -> None:
        self.layout = layout
        self.rng = np.random.default_rng(seed)
        self.payloads: dict[bytes, bytes] = {}
        self.pools: list[HostPool] = []

    def pool(self, capacity: int) -> HostPool:
        pool = HostPool(self.layout, capacity, populate=False)
        self.pools.append(pool)
        return pool

    def fill(self, pool: HostPool, keys: list[bytes]) -> None:
        n = self.layout.payload_bytes
        reservation = pool.reserve(keys)
        for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
            payload = self.payloads.setdefault(key, self.rng.bytes(n))
            pool.slot_memory(slot)[:n] = payload
        pool.commit(reservation, pool.hash_slots(reservation.slots))

    def check(self, pool: HostPool, keys: list[bytes]) -> None:
        n = self.layout.payload_bytes
        for key in keys:
            slot = pool.slot_of(key)
            assert slot is not None, f"{key.hex()} was not loaded"
            got = bytes(pool.slot_memory(slot)[:n])
            assert got == self.payloads[key], f"{key.hex()}: wrong bytes"

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


@contextlib.contextmanager
def _setup(open_tier: OpenTier, seed: int) -> Iterator[tuple[Any, _Blocks]]:
    layout = conformance_layout()
    blocks = _Blocks(layout, seed)
    tier = open_tier(layout)
    try:
        yield tier, blocks
    finally:
        tier.close()
        blocks.close()


# --- tier cases -----------------------------------------------------------------------------


def tier_round_trip(open_tier: OpenTier, seed: int = 0) -> None:
    """Blocks put from DRAM come back bit for bit; the tier lists and counts them."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(6)]
        source, target = blocks.pool(8), blocks.pool(8)
        blocks.fill(source, keys)
        assert tier.put(keys, source) == len(keys)
        assert tier.contains(keys) == [True] * len(keys)
        assert sorted(tier.keys()) == sorted(keys)
        assert tier.used == len(keys)
        tier.get(keys, target)
        blocks.check(target, keys)
        assert tier.stats.puts == len(keys) and tier.stats.hits == len(keys)


def tier_put_skips_stored_and_repeated_keys(open_tier: OpenTier, seed: int = 0) -> None:
    """``put`` returns how many blocks it wrote: stored and repeated keys are skipped."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(4)]
        source = blocks.pool(8)
        blocks.fill(source, keys)
        assert tier.put(keys[:2], source) == 2
        assert tier.put([keys[1], keys[2], keys[2], keys[3]], source) == 2
        assert tier.used == 4


def tier_put_refuses_keys_absent_from_the_source(open_tier: OpenTier, seed: int = 0) -> None:
    """A key the DRAM pool lacks: ``BlocksMissingError`` with a ``loaded`` mask, nothing
    written."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(3)]
        source = blocks.pool(8)
        blocks.fill(source, [keys[0], keys[2]])
        try:
            tier.put(keys, source)
        except BlocksMissingError as exc:
            assert exc.loaded == [True, False, True]
        else:
            raise AssertionError("put of a key absent from the source did not raise")
        assert tier.contains(keys) == [False] * 3


def tier_get_reports_misses_and_commits_the_rest(open_tier: OpenTier, seed: int = 0) -> None:
    """Absent keys are a ``BlocksMissingError`` whose ``loaded`` mask is exact; the blocks that
    were there are loaded; keys the target already holds count as loaded."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(5)]
        source, target = blocks.pool(8), blocks.pool(8)
        blocks.fill(source, keys[:3])
        tier.put(keys[:3], source)
        blocks.fill(target, [keys[4]])
        blocks.payloads.setdefault(keys[3], b"")
        request = [keys[0], keys[3], keys[1], keys[4]]
        try:
            tier.get(request, target)
        except BlocksMissingError as exc:
            assert exc.loaded == [True, False, True, True], exc.loaded
            assert exc.corrupt == 0
        else:
            raise AssertionError("get of an absent key did not raise")
        blocks.check(target, [keys[0], keys[1], keys[4]])
        assert target.contains([keys[3]]) == [False]
        assert target.free == 8 - 3  # no slot of the miss stays taken


def tier_get_into_a_full_target_reads_nothing(open_tier: OpenTier, seed: int = 0) -> None:
    """Too few free DRAM slots: ``TierFullError``, and the target is as it was."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(3)]
        source, target = blocks.pool(4), blocks.pool(2)
        blocks.fill(source, keys)
        tier.put(keys, source)
        blocks.fill(target, [_key(100)])
        try:
            tier.get(keys, target)
        except TierFullError:
            pass
        else:
            raise AssertionError("get into a target without room did not raise TierFullError")
        assert target.used == 1 and target.free == 1


def tier_delete_drops_blocks(open_tier: OpenTier, seed: int = 0) -> None:
    """``delete`` returns how many it dropped (absent keys skipped); they are misses after."""
    with _setup(open_tier, seed) as (tier, blocks):
        keys = [_key(i) for i in range(4)]
        source, target = blocks.pool(8), blocks.pool(8)
        blocks.fill(source, keys)
        tier.put(keys, source)
        assert tier.delete([keys[1], keys[3], _key(99)]) == 2
        assert tier.contains(keys) == [True, False, True, False]
        assert sorted(tier.keys()) == sorted([keys[0], keys[2]])
        try:
            tier.get([keys[0], keys[1]], target)
        except BlocksMissingError as exc:
            assert exc.loaded == [True, False]
        else:
            raise AssertionError("get of a deleted key did not raise")
        blocks.check(target, [keys[0]])


TIER_CASES: tuple[Callable[..., None], ...] = (
    tier_round_trip,
    tier_put_skips_stored_and_repeated_keys,
    tier_put_refuses_keys_absent_from_the_source,
    tier_get_reports_misses_and_commits_the_rest,
    tier_get_into_a_full_target_reads_nothing,
    tier_delete_drops_blocks,
)


def check_tier(open_tier: OpenTier, *, seed: int = 0) -> None:
    """Runs every tier case against tiers from ``open_tier(layout)`` (a fresh one each)."""
    for case in TIER_CASES:
        case(open_tier, seed)


# --- registry cases -------------------------------------------------------------------------


def _node(node_id: str) -> NodeInfo:
    return NodeInfo(node_id=node_id, addresses=(f"127.0.0.1:{7000 + len(node_id)}",))


def registry_publish_and_find_holders(make_registry: MakeRegistry) -> None:
    """Published keys are found with their holder; unknown keys have none."""
    registry = make_registry()
    try:
        keys = [_key(i) for i in range(4)]
        registry.register(_node("node-a"), ttl_s=30)
        registry.publish("node-a", keys[:3], "dram")
        held = registry.holders(keys)
        assert [[h.node_id for h in hs] for hs in held] == [["node-a"]] * 3 + [[]]
    finally:
        registry.close()


def registry_withdraw_removes_holders(make_registry: MakeRegistry) -> None:
    """Withdrawn keys are no longer listed for that node."""
    registry = make_registry()
    try:
        keys = [_key(i) for i in range(3)]
        registry.register(_node("node-a"), ttl_s=30)
        registry.publish("node-a", keys, "dram")
        registry.withdraw("node-a", keys[:2])
        assert [bool(hs) for hs in registry.holders(keys)] == [False, False, True]
    finally:
        registry.close()


def registry_unregister_drops_the_node(make_registry: MakeRegistry) -> None:
    """A registered node is listed and answers heartbeats; unregistered, it is gone with its
    keys, and a heartbeat for it says so (False)."""
    registry = make_registry()
    try:
        keys = [_key(i) for i in range(2)]
        registry.register(_node("node-a"), ttl_s=30)
        registry.register(_node("node-bb"), ttl_s=30)
        registry.publish("node-a", keys, "dram")
        assert sorted(n.node_id for n in registry.nodes()) == ["node-a", "node-bb"]
        assert registry.heartbeat("node-a", 30) is True
        registry.unregister("node-a")
        assert [n.node_id for n in registry.nodes()] == ["node-bb"]
        assert registry.holders(keys) == [[], []]
        assert registry.heartbeat("node-a", 30) is False
    finally:
        registry.close()


REGISTRY_CASES: tuple[Callable[..., None], ...] = (
    registry_publish_and_find_holders,
    registry_withdraw_removes_holders,
    registry_unregister_drops_the_node,
)


def check_registry(make_registry: MakeRegistry) -> None:
    """Runs every registry case against fresh registries from ``make_registry()``."""
    for case in REGISTRY_CASES:
        case(make_registry)


# --- pytest classes --------------------------------------------------------------------------


class TierConformance:
    """Subclass as ``class TestMyTier(TierConformance)`` and define ``open_tier(self,
    layout)``: pytest runs one test per tier case."""

    seed = 0

    def open_tier(self, layout: PoolLayout) -> Any:
        raise NotImplementedError("define open_tier(self, layout) in the subclass")


class RegistryConformance:
    """Subclass as ``class TestMyRegistry(RegistryConformance)`` and define
    ``make_registry(self)``: pytest runs one test per registry case."""

    def make_registry(self) -> Any:
        raise NotImplementedError("define make_registry(self) in the subclass")


def _tier_test(case: Callable[..., None]) -> Callable[[TierConformance], None]:
    def test(self: TierConformance) -> None:
        case(self.open_tier, self.seed)

    test.__doc__ = case.__doc__
    return test


def _registry_test(case: Callable[..., None]) -> Callable[[RegistryConformance], None]:
    def test(self: RegistryConformance) -> None:
        case(self.make_registry)

    test.__doc__ = case.__doc__
    return test


for _case in TIER_CASES:
    setattr(TierConformance, "test_" + _case.__name__, _tier_test(_case))
for _case in REGISTRY_CASES:
    setattr(RegistryConformance, "test_" + _case.__name__, _registry_test(_case))
