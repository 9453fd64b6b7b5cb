"""DiskPool.get_scattered: disk blocks read straight into the caller's memory, piece by piece,
each checked where it landed; a damaged, cut-off or absent block is a miss and never reported
loaded."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync._src.tiers.disk import pool as disk_pool_module
from tpusync.errors import InvalidArgumentError, PoolClosedError
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout, Scatter

# two arrays, 4 pieces each (the block axis after the first): 8 pieces of a block
ARRAYS = (
    ArrayLayout("k", "bfloat16", (4, 8, 96), 1, 1),
    ArrayLayout("v", "float32", (4, 8, 24), 1, 1),
)
LAYOUT = PoolLayout("landing-test", ARRAYS)
N = 24


def _key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


@pytest.fixture
def stored(tmp_path):
    """A disk pool holding N blocks of random bytes (slab of 8 slots: runs cross slabs), and
    the bytes of each."""
    rng = np.random.default_rng(7)
    keys = [_key(i) for i in range(N)]
    payloads = {}
    with HostPool(LAYOUT, N) as host:
        reservation = host.reserve(keys)
        for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
            data = rng.integers(0, 256, LAYOUT.payload_bytes, dtype=np.uint8)
            with host.slot_memory(slot) as memory:
                np.frombuffer(memory, np.uint8)[: LAYOUT.payload_bytes] = data
            payloads[key] = data
        host.commit(reservation, host.hash_slots(reservation.slots))
        disk = DiskPool(LAYOUT, 2 * N, tmp_path, slab_slots=8)
        disk.put(keys, host)
    try:
        yield disk, payloads
    finally:
        disk.close()


def _pieces_scatter(keys_count: int, target: np.ndarray, order: np.ndarray) -> Scatter:
    """Block i's pieces land, in payload order, in row ``order[i]`` of ``target`` (one row
    of payload_bytes per block), each piece at its own offset there."""
    offsets, _ = LAYOUT.piece_table
    base = target.ctypes.data + order.astype(np.uint64) * np.uint64(target.shape[1])
    targets = (base[:, None] + offsets[None, :].astype(np.uint64)).reshape(-1)
    first = np.arange(0, keys_count * len(offsets) + 1, len(offsets), dtype=np.int64)
    return Scatter(first, np.tile(offsets, keys_count), targets)


def test_blocks_land_bit_exact_in_their_places_and_nothing_else_changes(stored) -> None:
    disk, payloads = stored
    keys = [_key(i) for i in (5, 6, 7, 8, 9, 20, 2, 3)]  # runs across a slab's end, out of order
    target = np.random.default_rng(1).integers(0, 256, (12, LAYOUT.payload_bytes), np.uint8)
    before = target.copy()
    order = np.array([11, 0, 4, 3, 9, 1, 7, 6])
    loaded = disk.get_scattered(keys, _pieces_scatter(len(keys), target, order))
    assert loaded == [True] * len(keys)
    for key, row in zip(keys, order, strict=True):
        assert np.array_equal(target[row], payloads[key])
    untouched = [r for r in range(12) if r not in order]
    assert np.array_equal(target[untouched], before[untouched])
    assert disk.stats.hits == len(keys)
    assert len(disk) == N  # nothing deleted, nothing promoted anywhere


@settings(  # the pool is only read here: one serves every example
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_any_cut_of_the_payload_into_runs_lands_the_same_bytes(stored, data) -> None:
    """Runs that cut pieces, span several, or land nowhere (hashed, then dropped): every run
    with a place gets exactly its bytes, and the block is verified over all of them."""
    disk, payloads = stored
    picks = data.draw(st.lists(st.integers(0, N - 1), min_size=1, max_size=6, unique=True))
    keys = [_key(i) for i in picks]
    payload = LAYOUT.payload_bytes
    target = np.zeros((len(keys), payload), np.uint8)
    first, offsets, targets, kept = [0], [], [], []
    for b in range(len(keys)):
        cuts = sorted(
            data.draw(st.sets(st.integers(1, payload - 1), max_size=5), label=f"cuts {b}")
        )
        starts = [0, *cuts]
        for start, end in zip(starts, [*cuts, payload], strict=True):
            land = data.draw(st.booleans(), label="lands")
            offsets.append(start)
            targets.append(target[b].ctypes.data + start if land else 0)
            if land:
                kept.append((b, start, end))
        first.append(len(offsets))
    scatter = Scatter(np.array(first), np.array(offsets), np.array(targets, dtype=np.uint64))
    assert disk.get_scattered(keys, scatter) == [True] * len(keys)
    for b, start, end in kept:
        assert np.array_equal(target[b, start:end], payloads[keys[b]][start:end])


def _slab_of(disk: DiskPool, key: bytes) -> tuple[str, int]:
    slot = disk._index[key]
    fd, offset = disk._locate(slot)
    return os.readlink(f"/proc/self/fd/{fd}"), offset


def test_a_damaged_block_is_a_miss_counted_and_deleted_its_neighbours_load(stored) -> None:
    disk, payloads = stored
    keys = [_key(i) for i in range(8)]  # one run
    path, offset = _slab_of(disk, keys[3])
    with open(path, "r+b") as slab:
        slab.seek(offset + 1000)
        byte = slab.read(1)
        slab.seek(offset + 1000)
        slab.write(bytes([byte[0] ^ 0x40]))
    target = np.zeros((8, LAYOUT.payload_bytes), np.uint8)
    loaded = disk.get_scattered(keys, _pieces_scatter(8, target, np.arange(8)))
    assert loaded == [i != 3 for i in range(8)]
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert np.array_equal(target[i], payloads[keys[i]])
    assert disk.stats.checksum_failures == 1
    assert disk.contains([keys[3]]) == [False]


def test_a_slab_cut_short_loses_only_the_blocks_past_its_end(stored, caplog) -> None:
    disk, payloads = stored
    keys = [_key(i) for i in range(16)]  # slabs 0 and 1
    path, offset = _slab_of(disk, keys[13])
    os.truncate(path, offset + 100)  # blocks 13.. of slab 1 end early
    target = np.zeros((16, LAYOUT.payload_bytes), np.uint8)
    loaded = disk.get_scattered(keys, _pieces_scatter(16, target, np.arange(16)))
    assert loaded == [i < 13 for i in range(16)]
    for i in range(13):
        assert np.array_equal(target[i], payloads[keys[i]])
    assert "could not be read" in caplog.text and "short" in caplog.text
    assert disk.contains(keys[13:]) == [False] * 3


def test_absent_keys_are_misses_and_the_rest_loads(stored) -> None:
    disk, payloads = stored
    keys = [_key(1), _key(999), _key(2)]
    target = np.zeros((3, LAYOUT.payload_bytes), np.uint8)
    assert disk.get_scattered(keys, _pieces_scatter(3, target, np.arange(3))) == [
        True,
        False,
        True,
    ]
    assert np.array_equal(target[2], payloads[_key(2)])


def test_bad_arguments_are_refused_before_any_read(stored) -> None:
    disk, _ = stored
    target = np.zeros((2, LAYOUT.payload_bytes), np.uint8)
    scatter = _pieces_scatter(2, target, np.arange(2))
    with pytest.raises(InvalidArgumentError, match="repeated"):
        disk.get_scattered([_key(1), _key(1)], scatter)
    with pytest.raises(InvalidArgumentError, match="scatter"):
        disk.get_scattered([_key(1)], scatter)  # two blocks' runs for one key
    assert not target.any()
    disk.close()
    with pytest.raises(PoolClosedError):
        disk.get_scattered([_key(1), _key(2)], scatter)


def test_reads_go_in_runs_of_at_most_the_landing_size(stored, monkeypatch) -> None:
    """A hit read in place goes in runs of LANDING_RUN_BYTES (a run is copied out while the
    others still read), not the DRAM path's 4 MiB."""
    disk, _ = stored
    sizes = []
    original = disk_pool_module._errors_by_block

    def counting(runs, read):
        sizes.extend(len(run) for run in runs)
        return original(runs, read)

    monkeypatch.setattr(disk_pool_module, "_errors_by_block", counting)
    monkeypatch.setattr(disk_pool_module, "LANDING_RUN_BYTES", 2 * LAYOUT.slot_bytes)
    keys = [_key(i) for i in range(8)]
    target = np.zeros((8, LAYOUT.payload_bytes), np.uint8)
    assert all(disk.get_scattered(keys, _pieces_scatter(8, target, np.arange(8))))
    assert sizes == [2, 2, 2, 2]
