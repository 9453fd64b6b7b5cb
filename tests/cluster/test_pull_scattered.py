"""BlockClient.pull_scattered: blocks received straight into the caller's places, run by run,
from a real BlockServer over real sockets (plain and TLS), with random bits: every verified
block's bytes are exactly where its runs say and nowhere else; a block missing, recorded
otherwise than asked, damaged in flight or announced with another checksum is False; bad
arguments are refused before any byte moves."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tools import self_signed_tls

from tpusync._src.cluster.dataplane import wire
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    RegistryPool,
    RemotePool,
    StoreNode,
    StoreNodePool,
)
from tpusync.errors import InvalidArgumentError
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout, Scatter

SECRET = b"p" * 32
LAYOUT = PoolLayout(
    "scatter-test",
    (ArrayLayout("w", "bfloat16", (3, 1000), 0, 1), ArrayLayout("b", "int8", (77,), 0, 1)),
)
SIZE = LAYOUT.payload_bytes
KEYS = [b"chunk-%d" % i for i in range(12)]


def filled(layout: PoolLayout, keys: list[bytes], rng: np.random.Generator) -> HostPool:
    """A pool of ``layout`` holding random blocks under ``keys``."""
    pool = HostPool(layout, len(keys))
    size = layout.payload_bytes
    reservation = pool.reserve(keys)
    for slot in reservation.slots.tolist():
        with pool.slot_memory(slot) as memory:
            memory[:size] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    return pool


@pytest.fixture
def source(rng: np.random.Generator) -> Iterator[HostPool]:
    with filled(LAYOUT, KEYS, rng) as pool:
        yield pool


def payload(pool: HostPool, key: bytes) -> np.ndarray:
    slot = pool.slot_of(key)
    assert slot is not None
    with pool.slot_memory(slot) as memory:
        return np.frombuffer(bytes(memory[: pool.layout.payload_bytes]), dtype=np.uint8)


class Places:
    """Random runs for each key (some landing nowhere), laid out shuffled with gaps in an arena
    of random bytes, and what the arena must hold after a pull."""

    def __init__(self, rng: np.random.Generator, keys: int, size: int = SIZE) -> None:
        cuts = [
            np.sort(rng.choice(np.arange(1, size), rng.integers(0, 40), False)) for _ in range(keys)
        ]
        offsets = [np.concatenate(([0], c)) for c in cuts]
        self.first = np.concatenate(([0], np.cumsum([len(o) for o in offsets])))
        self.offsets = np.concatenate(offsets).astype(np.int64)
        self.lengths = np.concatenate([np.diff(np.append(o, size)) for o in offsets])
        runs = len(self.lengths)
        order = rng.permutation(runs)
        place = np.empty(runs, dtype=np.int64)
        place[order] = (
            np.cumsum(self.lengths[order] + rng.integers(1, 50, runs)) - self.lengths[order]
        )
        self.place = place
        self.nowhere = rng.random(runs) < 0.2
        self.arena = rng.integers(0, 256, int(place.max() + self.lengths.max() + 64), np.uint8)
        self.before = self.arena.copy()
        targets = (self.arena.ctypes.data + place).astype(np.uint64)
        targets[self.nowhere] = 0
        self.scatter = Scatter(self.first, self.offsets, targets)

    def expected(self, payloads: dict[int, np.ndarray]) -> np.ndarray:
        """The arena once the blocks ``payloads`` (by key index) landed, the others not."""
        out = self.before.copy()
        for i, data in payloads.items():
            for r in range(self.first[i], self.first[i + 1]):
                if not self.nowhere[r]:
                    start = self.offsets[r]
                    out[self.place[r] : self.place[r] + self.lengths[r]] = data[
                        start : start + self.lengths[r]
                    ]
        return out

    def untouched(self, i: int) -> bool:
        """Whether key ``i``'s places still hold what they held before."""
        return all(
            np.array_equal(
                self.arena[self.place[r] : self.place[r] + self.lengths[r]],
                self.before[self.place[r] : self.place[r] + self.lengths[r]],
            )
            for r in range(self.first[i], self.first[i + 1])
        )


class Damaging(BlockServer):
    """A server that flips one bit of ``victim``'s payload on the wire."""

    def __init__(self, *args: Any, victim: bytes = KEYS[4], **kwargs: Any) -> None:
        self.victim = victim
        super().__init__(*args, **kwargs)

    def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
        if wire.decode_header(header, max_payload=1 << 30).key == self.victim:
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x04
            data = memoryview(damaged)
        super()._send_block(conn, header, data)


@pytest.mark.parametrize("connections", [1, 3])
def test_blocks_land_exactly_in_their_places(
    source: HostPool, rng: np.random.Generator, connections: int
) -> None:
    with (
        BlockServer(source, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET, connections=connections) as client,
    ):
        for _ in range(3):
            places = Places(rng, len(KEYS))
            assert client.pull_scattered(KEYS, LAYOUT, places.scatter) == [True] * len(KEYS)
            want = places.expected({i: payload(source, k) for i, k in enumerate(KEYS)})
            assert np.array_equal(places.arena, want)  # and nothing outside the runs moved


def test_missing_and_otherwise_recorded_blocks_are_false_and_not_fetched(
    source: HostPool, rng: np.random.Generator
) -> None:
    keys = [KEYS[0], b"absent", KEYS[2], KEYS[3]]
    pinned = source.pin(keys)
    required = np.array(pinned.checksums, dtype=np.uint64)
    source.unpin(pinned)
    required[3] ^= np.uint64(1)  # key 3: the caller wants other bytes than the server has
    places = Places(rng, len(keys))
    with (
        BlockServer(source, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
    ):
        loaded = client.pull_scattered(keys, LAYOUT, places.scatter, checksums=required)
    assert loaded == [True, False, True, False]
    assert places.untouched(1) and places.untouched(3)
    want = places.expected({0: payload(source, KEYS[0]), 2: payload(source, KEYS[2])})
    assert np.array_equal(places.arena, want)


def test_a_block_damaged_in_flight_is_false(source: HostPool, rng: np.random.Generator) -> None:
    victim = KEYS[4]
    places = Places(rng, len(KEYS))
    with (
        Damaging(source, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET, connections=2) as client,
    ):
        loaded = client.pull_scattered(KEYS, LAYOUT, places.scatter)
    assert loaded == [k != victim for k in KEYS]
    for i, key in enumerate(KEYS):
        if key != victim:
            want = places.expected({i: payload(source, key)})
            for r in range(places.first[i], places.first[i + 1]):
                span = slice(places.place[r], places.place[r] + places.lengths[r])
                assert np.array_equal(places.arena[span], want[span])


def test_a_block_announced_with_another_checksum_never_reaches_its_places(
    source: HostPool, rng: np.random.Generator
) -> None:
    """The receiver stops at a header it did not expect; the block is then received aside
    (scratch) and judged there: it fails, and its places stay as they were."""
    victim = KEYS[1]

    class Lying(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            h = wire.decode_header(header, max_payload=1 << 30)
            if h.key == victim:
                header = wire.encode_header(
                    wire.BLOCK, h.request_id, h.key, h.fingerprint, h.payload_length,
                    h.checksum ^ 1,
                )  # fmt: skip
            super()._send_block(conn, header, data)

    places = Places(rng, len(KEYS))
    with (
        Lying(source, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
    ):
        loaded = client.pull_scattered(KEYS, LAYOUT, places.scatter)
    assert loaded == [k != victim for k in KEYS]
    assert places.untouched(1)
    want = places.expected({i: payload(source, k) for i, k in enumerate(KEYS) if k != victim})
    assert np.array_equal(places.arena, want)


def test_over_tls_blocks_land_in_their_places(
    source: HostPool, rng: np.random.Generator, tmp_path: Path
) -> None:
    server_tls, client_tls = self_signed_tls(tmp_path)
    places = Places(rng, len(KEYS))
    with (
        BlockServer(source, secret=SECRET, tls=server_tls) as server,
        BlockClient(server.address, secret=SECRET, tls=client_tls, connections=2) as client,
    ):
        assert client.pull_scattered(KEYS, LAYOUT, places.scatter) == [True] * len(KEYS)
    want = places.expected({i: payload(source, k) for i, k in enumerate(KEYS)})
    assert np.array_equal(places.arena, want)


def test_bad_arguments_are_refused_before_any_byte_moves(
    source: HostPool, rng: np.random.Generator
) -> None:
    places = Places(rng, 2)
    s = places.scatter
    other = PoolLayout("other", (ArrayLayout("x", "float32", (5,), 0, 1),))
    shifted = s.offsets.copy()
    shifted[0] = 3
    cases = [
        ((KEYS[:1] * 2, LAYOUT, s), {}, "each key once"),
        ((KEYS[:2], other, s), {}, "not the block layout"),
        ((KEYS[:2], "layout", s), {}, "expected a PoolLayout"),
        ((KEYS[:3], LAYOUT, s), {}, "scatter: expected first of 4"),
        ((KEYS[:2], LAYOUT, Scatter(s.first, shifted, s.targets)), {}, "start at offset 0"),
        ((KEYS[:2], LAYOUT, Scatter(np.array([0, 0, len(s.offsets)]), s.offsets, s.targets)),
         {}, "a run each"),
        ((KEYS[:2], LAYOUT, s), {"checksums": np.zeros(3, np.uint64)}, "checksums: expected"),
        ((KEYS[:2], LAYOUT, s), {"checksums": np.zeros(2, np.float32)}, "checksums: expected"),
    ]  # fmt: skip
    with (
        BlockServer(source, secret=SECRET) as server,
        BlockClient(server.address, secret=SECRET) as client,
    ):
        for args, kwargs, match in cases:
            with pytest.raises(InvalidArgumentError, match=match):
                client.pull_scattered(*args, **kwargs)
        assert np.array_equal(places.arena, places.before)
        assert client.pull_scattered(KEYS[:2], LAYOUT, s) == [True, True]  # still usable


def _split(source: HostPool, keys: list[bytes]) -> HostPool:
    """A pool holding copies of ``source``'s blocks under ``keys``."""
    pool = HostPool(LAYOUT, 16)
    reservation = pool.reserve(keys)
    for slot, key in zip(reservation.slots.tolist(), keys, strict=True):
        with pool.slot_memory(slot) as memory:
            memory[:SIZE] = payload(source, key).tobytes()
    pool.commit(reservation, pool.hash_slots(reservation.slots))
    return pool


def test_a_remote_pool_counts_blocks_that_fail_verification(
    source: HostPool, rng: np.random.Generator
) -> None:
    places = Places(rng, len(KEYS))
    with (
        Damaging(source, secret=SECRET) as server,
        RemotePool(BlockClient(server.address, secret=SECRET, connections=2), LAYOUT) as peer,
    ):
        loaded = peer.get_scattered(KEYS, places.scatter)
    assert loaded == [k != KEYS[4] for k in KEYS]
    assert peer.stats.checksum_failures == 1
    assert peer.stats.hits == len(KEYS) - 1 and peer.stats.misses == 1


def test_a_registry_pool_lands_keys_held_by_two_peers(
    source: HostPool, rng: np.random.Generator
) -> None:
    """Half the keys on one peer, half on another (which damages one in flight), one key on
    none: each held key lands from its holder, in its places; the damaged one and the absent
    one are False, and the pool counts them."""
    keys = [*KEYS, b"absent"]
    held = {"peer-a": KEYS[:6], "peer-b": KEYS[6:]}
    registry = MemoryRegistry()
    with (
        _split(source, held["peer-a"]) as pool_a,
        _split(source, held["peer-b"]) as pool_b,
        BlockServer(pool_a, secret=SECRET) as server_a,
        Damaging(pool_b, secret=SECRET, victim=KEYS[7]) as server_b,
    ):
        for node, server in (("peer-a", server_a), ("peer-b", server_b)):
            registry.register(NodeInfo(node, addresses=(server.address,)), ttl_s=60)
            registry.publish(node, held[node], "dram")
        places = Places(rng, len(keys))
        with RegistryPool(registry, LAYOUT, secret=SECRET, timeout_s=5) as cluster:
            loaded = cluster.get_scattered(keys, places.scatter)
            assert loaded == [k not in (KEYS[7], b"absent") for k in keys]
            assert cluster.stats.hits == len(KEYS) - 1
            assert cluster.stats.checksum_failures == 1
        landed = {i: payload(source, k) for i, k in enumerate(KEYS) if k != KEYS[7]}
        want = places.expected(landed)
        for i in landed:
            for r in range(places.first[i], places.first[i + 1]):
                span = slice(places.place[r], places.place[r] + places.lengths[r])
                assert np.array_equal(places.arena[span], want[span])
        assert places.untouched(len(keys) - 1)


def test_a_store_node_pool_asks_at_most_the_nodes_dram_per_lease(
    rng: np.random.Generator, tmp_path: Path
) -> None:
    """A node holding more blocks than its DRAM has slots (the rest on its disk): the pull is
    cut into leases of at most its DRAM slots, each moving its blocks up, and every block
    lands."""
    big = PoolLayout("scatter-big", (ArrayLayout("w", "bfloat16", (3, 50_000), 0, 1),))
    with (
        filled(big, KEYS, rng) as source,
        StoreNode(1 << 20, secret=SECRET, disk_dir=tmp_path, disk_bytes=8 << 20) as node,
        StoreNodePool(node.address, layout=big, secret=SECRET, timeout_s=5) as tier,
    ):
        capacity = tier.client.server_capacity
        assert 2 <= capacity < len(KEYS) // 2
        stored = KEYS[: 2 * capacity + 1]
        assert tier.put(stored, source) == len(stored)
        keys = [*stored, b"absent"]
        places = Places(rng, len(keys), big.payload_bytes)
        loaded = tier.get_scattered(keys, places.scatter)
        assert loaded == [k in stored for k in keys]
        want = places.expected({i: payload(source, k) for i, k in enumerate(stored)})
        assert np.array_equal(places.arena, want)
