"""The native copy engine and page-aligned mappings, tested directly against numpy."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core

STREAMING_JOB = 8 << 20  # the engine streams jobs at least this large (copy_engine.c)


def _segments(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    table = np.array(
        [(src.ctypes.data + s, dst.ctypes.data + d, n) for s, d, n in rows], dtype=np.uint64
    )
    return table.reshape(-1, 3)


def _reference(src: np.ndarray, dst: np.ndarray, rows: list[tuple[int, int, int]]) -> np.ndarray:
    out = dst.copy()
    for s, d, n in rows:
        out[d : d + n] = src[s : s + n]
    return out


@st.composite
def segment_plans(draw: st.DrawFn) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Random disjoint destination ranges of random (often odd) sizes and unaligned offsets."""
    n = draw(st.integers(0, 40))
    sizes = draw(st.lists(st.integers(0, 70_000), min_size=n, max_size=n))
    gaps = draw(st.lists(st.integers(0, 300), min_size=n, max_size=n))
    src_size = max([*sizes, 1]) + 5_000
    rows, cursor = [], draw(st.integers(0, 63))
    for size, gap in zip(sizes, gaps, strict=True):
        cursor += gap
        rows.append((draw(st.integers(0, src_size - size)), cursor, size))
        cursor += size
    return src_size, cursor + 64, rows


@settings(max_examples=60, deadline=None)
@given(plan=segment_plans(), threads=st.integers(1, 4), min_parallel=st.sampled_from([0, 1 << 30]))
def test_copy_matches_numpy(plan: tuple[int, int, list], threads: int, min_parallel: int) -> None:
    src_size, dst_size, rows = plan
    rng = np.random.default_rng(len(rows) * 7919 + threads)
    src = rng.integers(1, 256, src_size, dtype=np.uint8)
    dst = rng.integers(1, 256, dst_size, dtype=np.uint8)
    expected = _reference(src, dst, rows)
    engine = _core.CopyEngine(threads, min_parallel_bytes=min_parallel)
    copied = engine.copy(_segments(src, dst, rows))
    assert copied == sum(n for _, _, n in rows)
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("block", [4096, 65_536 + 17, 1 << 20])
def test_streaming_jobs_copy_exactly(threads: int, block: int) -> None:
    """Jobs above the streaming threshold take the non-temporal path: odd sizes, unaligned
    destinations, scattered order."""
    rng = np.random.default_rng(block + threads)
    n_blocks = STREAMING_JOB // block + 3
    src = rng.integers(1, 256, n_blocks * block + 64, dtype=np.uint8)
    dst = np.zeros(n_blocks * block + 128, dtype=np.uint8)
    order = rng.permutation(n_blocks)
    rows = [(int(order[i]) * block + 3, i * block + 5, block) for i in range(n_blocks)]
    engine = _core.CopyEngine(threads)
    assert engine.copy(_segments(src, dst, rows)) == n_blocks * block
    np.testing.assert_array_equal(dst, _reference(src, np.zeros_like(dst), rows))


def test_engine_rejects_bad_tables() -> None:
    engine = _core.CopyEngine(2)
    with pytest.raises(ValueError, match="uint64 array of shape"):
        engine.copy(np.zeros((3, 2), np.uint64))
    with pytest.raises(ValueError, match="uint64 array of shape"):
        engine.copy(np.zeros((3, 3), np.int64))
    assert engine.copy(np.empty((0, 3), np.uint64)) == 0
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _core.CopyEngine(0)


def test_block_segments_merge_only_runs_contiguous_on_both_sides() -> None:
    outer = np.array([1000], dtype=np.int64)
    dst_outer = np.array([5000], dtype=np.int64)
    src_blocks = np.array([0, 1, 2, 5, 6], dtype=np.int64)
    dst_blocks = np.array([0, 1, 3, 4, 5], dtype=np.int64)
    merged = _core.block_segments(outer, 10, dst_outer, 10, src_blocks, dst_blocks, 10)
    assert merged.tolist() == [[1000, 5000, 20], [1020, 5030, 10], [1050, 5040, 20]]
    unmerged = _core.block_segments(
        outer, 10, dst_outer, 10, src_blocks, dst_blocks, 10, merge=False
    )
    assert len(unmerged) == 5 and unmerged[:, 2].tolist() == [10] * 5
    two_outer = _core.block_segments(
        np.array([0, 100], dtype=np.int64),
        10,
        np.array([0, 20], dtype=np.int64),
        10,
        np.array([0, 1], dtype=np.int64),
        np.array([0, 1], dtype=np.int64),
        10,
    )
    assert two_outer.tolist() == [[0, 0, 20], [100, 20, 20]]  # rows of different outers
    with pytest.raises(ValueError, match="differ in length"):
        _core.block_segments(outer, 10, dst_outer, 10, src_blocks, dst_blocks[:2], 10)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 2**40),
            st.integers(1, 2**20),
            st.integers(0, 2**40),
            st.integers(1, 2**20),
            st.integers(1, 2**20),
        ),
        min_size=1,
        max_size=6,
    ),
    blocks=st.lists(st.tuples(st.integers(0, 4096), st.integers(0, 4096)), max_size=40),
)
def test_block_rows_are_the_per_row_segments(rows: list, blocks: list) -> None:
    """BlockRows.rows (a plan's table, one C pass) equals block_segments row by row,
    unmerged."""
    src_base, src_step, dst_base, dst_step, nbytes = (
        np.array(c, dtype=np.int64) for c in zip(*rows, strict=True)
    )
    src_blocks = np.array([b[0] for b in blocks], dtype=np.int64)
    dst_blocks = np.array([b[1] for b in blocks], dtype=np.int64)
    # each row its own pair of bases, half of them split between the pair and the row
    half = np.stack([src_base // 2, dst_base // 2], axis=1)
    rows_plan = _core.BlockRows(
        np.arange(len(rows), dtype=np.int64),
        src_base - half[:, 0],
        src_step,
        dst_base - half[:, 1],
        dst_step,
        nbytes.astype(np.uint64),
        len(rows),
    )
    table = rows_plan.rows(half, src_blocks, dst_blocks)
    expected = [
        _core.block_segments(
            src_base[r : r + 1],
            int(src_step[r]),
            dst_base[r : r + 1],
            int(dst_step[r]),
            src_blocks,
            dst_blocks,
            int(nbytes[r]),
            merge=False,
        )
        for r in range(len(rows))
    ]
    assert np.array_equal(table, np.concatenate(expected).reshape(-1, 3))
    if len(table):
        lo, hi = table[:, 0].min(), (table[:, 0] + table[:, 2]).max()
        dlo, dhi = table[:, 1].min(), (table[:, 1] + table[:, 2]).max()
        assert _core.table_bounds(table) == (lo, hi, dlo, dhi)


def test_block_rows_refuses_a_row_without_a_pair_and_bad_bases() -> None:
    """A pair index outside the pairs is refused when the plan is made, before anything is
    read through it; so are bases of the wrong shape and block lists of unequal length."""
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="pair_of_row"):
        _core.BlockRows(np.array([1]), one, one, one, one, np.ones(1, np.uint64), 1)
    with pytest.raises(ValueError, match="differ in length"):
        _core.BlockRows(np.array([0]), one, one, one, np.zeros(2, np.int64), one.view(np.uint64), 1)
    plan = _core.BlockRows(np.array([0]), one, one, one, one, np.ones(1, np.uint64), 1)
    with pytest.raises(ValueError, match="pair_bases"):
        plan.rows(np.zeros((2, 2), np.int64), one, one)
    with pytest.raises(ValueError, match="block lists"):
        plan.rows(np.zeros((1, 2), np.int64), one, np.zeros(2, np.int64))


def test_mapping_is_page_aligned_prefaulted_and_guarded() -> None:
    mapping = _core.Mapping(10_000)
    assert mapping.address % _core.PAGE_SIZE == 0
    assert mapping.size % _core.PAGE_SIZE == 0 and mapping.size >= 10_000
    view = np.frombuffer(mapping, dtype=np.uint8)
    view[:] = 7
    with pytest.raises(BufferError, match="still alive"):
        mapping.close()
    del view
    mapping.close()
    assert mapping.closed and mapping.address == 0
    with pytest.raises(ValueError, match="closed"):
        np.frombuffer(mapping, dtype=np.uint8)
    with pytest.raises(ValueError, match="size must be > 0"):
        _core.Mapping(0)


def test_populate_ranges_are_checked() -> None:
    mapping = _core.Mapping(1 << 20, populate=False)
    mapping.populate(4096, 8192)
    mapping.populate()
    with pytest.raises(ValueError, match="outside the mapping"):
        mapping.populate(1 << 20, 10)
    with pytest.raises(ValueError, match="outside the mapping"):
        mapping.populate(0, (1 << 20) + 1)
    mapping.close()
    with pytest.raises(ValueError, match="closed"):
        mapping.populate()


@settings(max_examples=60, deadline=None)
@given(
    index=st.dictionaries(st.binary(min_size=1, max_size=4), st.integers(0, 15), max_size=12),
    keys=st.lists(st.binary(min_size=1, max_size=4), max_size=20),
)
def test_pin_slots_matches_a_plain_loop(index: dict, keys: list) -> None:
    """pin_slots (a pool's pin in one pass) answers each key's slot and checksum as a plain
    loop does, pins each present occurrence once (duplicates too), and unpin_slots undoes it."""
    rng = np.random.default_rng(len(keys))
    records = np.zeros(16, dtype=[("state", np.uint8), ("checksum", np.uint64)])
    records["checksum"] = rng.integers(1, 2**63, 16, dtype=np.uint64)
    pins = rng.integers(0, 3, 16).astype(np.int64)
    before = pins.copy()
    slots, sums, all_present = _core.pin_slots(index, keys, pins, records["checksum"])
    expected_slots = np.array([index.get(k, -1) for k in keys], dtype=np.int64)
    assert np.array_equal(slots, expected_slots)
    assert sums.tolist() == [int(records["checksum"][s]) if s >= 0 else 0 for s in expected_slots]
    assert all_present == all(k in index for k in keys)
    added = np.zeros(16, np.int64)
    np.add.at(added, expected_slots[expected_slots >= 0], 1)
    assert np.array_equal(pins, before + added)
    _core.unpin_slots(pins, slots)
    assert np.array_equal(pins, before)


@settings(max_examples=80, deadline=None)
@given(ids=st.lists(st.integers(-3, 40), max_size=70), limit=st.integers(0, 40))
def test_block_ids_status_matches_a_plain_check(ids: list, limit: int) -> None:
    """block_ids_status (the KV store's id check in one pass) answers as a plain check does:
    out of range first, then a repeat; the ids are left as they were."""
    array = np.array(ids, dtype=np.int64)
    before = array.copy()
    if any(not 0 <= i < limit for i in ids):
        expected = 1
    elif len(set(ids)) != len(ids):
        expected = 2
    else:
        expected = 0
    assert _core.block_ids_status(array, limit) == expected
    assert np.array_equal(array, before)


def test_pin_slots_refuses_a_slot_outside_the_pool_and_pins_nothing() -> None:
    pins = np.zeros(4, np.int64)
    checksums = np.arange(4, dtype=np.uint64)
    with pytest.raises(IndexError, match="outside the pool"):
        _core.pin_slots({b"a": 1, b"b": 4}, [b"a", b"b"], pins, checksums)
    assert not pins.any()
