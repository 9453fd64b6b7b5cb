"""BlockClient.pull_scattered: blocks received straight into the caller's places, run by run,
from a real BlockServer over real sockets (plain and TLS), with random bits: every verified
block's bytes are exactly where its runs say and nowhere else; a block missing, recorded
otherwise than asked, damaged in flight or announced with another checksum is False; bad
arguments are refused before any byte moves."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tools import self_signed_tls

from tpusync.cluster import BlockClient, BlockServer, Scatter
from tpusync.cluster.dataplane import wire
from tpusync.errors import InvalidArgumentError
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

SECRET = b"p" * 32
LAYOUT = PoolLayout(
    "scatter-test",
    (ArrayLayout("w", "bfloat16", (3, 1000), 0, 1), ArrayLayout("b", "int8", (77,), 0, 1)),
)
SIZE = LAYOUT.payload_bytes
KEYS = [b"chunk-%d" % i for i in range(12)]


@pytest.fixture
def source(rng: np.random.Generator) -> Iterator[HostPool]:
    with HostPool(LAYOUT, 16) as pool:
        reservation = pool.reserve(KEYS)
        for slot in reservation.slots.tolist():
            with pool.slot_memory(slot) as memory:
                memory[:SIZE] = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
        pool.commit(reservation, pool.hash_slots(reservation.slots))
        yield pool


def payload(pool: HostPool, key: bytes) -> np.ndarray:
    slot = pool.slot_of(key)
    assert slot is not None
    with pool.slot_memory(slot) as memory:
        return np.frombuffer(bytes(memory[:SIZE]), dtype=np.uint8)


class Places:
    """Random runs for each key (some landing nowhere), laid out shuffled with gaps in an arena
    of random bytes, and what the arena must hold after a pull."""

    def __init__(self, rng: np.random.Generator, keys: int) -> None:
        cuts = [
            np.sort(rng.choice(np.arange(1, SIZE), rng.integers(0, 40), False)) for _ in range(keys)
        ]
        offsets = [np.concatenate(([0], c)) for c in cuts]
        self.first = np.concatenate(([0], np.cumsum([len(o) for o in offsets])))
        self.offsets = np.concatenate(offsets).astype(np.int64)
        self.lengths = np.concatenate([np.diff(np.append(o, SIZE)) for o in offsets])
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

    class Damaging(BlockServer):
        def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
            if wire.decode_header(header, max_payload=1 << 30).key == victim:
                damaged = bytearray(data)
                damaged[len(damaged) // 2] ^= 0x04
                data = memoryview(damaged)
            super()._send_block(conn, header, data)

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
