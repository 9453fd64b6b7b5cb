"""Checksums of stored blocks: CRC-32C, the three-lane piece checksum (sum64), XXH64, and the
copy engine's fused copy-and-checksum, on every code path: AVX-512 carry-less multiplication,
the CRC instruction alone, and the portable tables."""

from __future__ import annotations

import platform
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
import sum64_model
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core

STREAMING_JOB = 8 << 20
T = TypeVar("T")


# The checksum's code paths (_core._force_portable_checksum): 0 the fastest the CPU has (AVX-512
# carry-less multiplication where available, else 128-bit), 3 the 128-bit carry-less
# multiplication even where AVX-512 is there, 2 the CRC instruction only, 1 the portable tables.
FASTEST, PORTABLE, CRC_INSTRUCTION, CLMUL128 = 0, 1, 2, 3
PATHS = [FASTEST, CLMUL128, CRC_INSTRUCTION, PORTABLE]
PATH_IDS = ["fastest", "clmul128", "crc-instruction", "portable"]


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def test_each_path_runs_the_kernel_it_names() -> None:
    """A forced path the CPU lacks falls back to another kernel, so its tests would test that
    one: on an x86 CPU with PCLMULQDQ and SSE 4.2 (every one this project runs on) each path
    must be its own kernel, and the fastest the 512-bit one where AVX-512 has VPCLMULQDQ."""
    expected = dict.fromkeys(PATHS, "table")  # elsewhere: the portable code on every path
    if platform.machine() == "x86_64":
        flags = _cpu_flags()
        assert {"pclmulqdq", "sse4_2"} <= flags, "this CPU lacks PCLMULQDQ or SSE 4.2"
        wide = {"avx512f", "vpclmulqdq"} <= flags
        expected = {
            FASTEST: "clmul512" if wide else "clmul128",
            CLMUL128: "clmul128",
            CRC_INSTRUCTION: "crc32",
            PORTABLE: "table",
        }
    for path, kernel in expected.items():
        assert _on_path(path, _core._checksum_kernel) == kernel, PATH_IDS[PATHS.index(path)]


@pytest.fixture(params=PATHS, ids=PATH_IDS)
def portable(request: pytest.FixtureRequest) -> object:
    _core._force_portable_checksum(request.param)
    yield request.param
    _core._force_portable_checksum(FASTEST)


def _on_path(path: int, fn: Callable[..., T], *args: object) -> T:
    _core._force_portable_checksum(path)
    try:
        return fn(*args)
    finally:
        _core._force_portable_checksum(FASTEST)


def _pattern(n: int) -> np.ndarray:
    """Deterministic bytes that look random: a fixed input for the pinned long vectors."""
    words = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) >> np.uint64(29)
    return words.astype(np.uint8)


def test_crc32c_check_value(portable: bool) -> None:
    assert _core.crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value
    assert _core.crc32c(b"") == 0


def test_sum64_golden_vectors(portable: bool) -> None:
    """Pins format 1 of the piece checksum: changing it needs a new format version."""
    assert _core.sum64(bytes(range(256)) * 5) == 0xA704A36B32BED5EF
    assert _core.sum64(b"tpusync") == 0xD56A606636FCBA1C
    assert _core.sum64(b"") == 0
    # long inputs take the wide paths (four streams of 12 KiB and the smaller ones, one stream)
    data = _pattern((4 << 20) + 77)
    assert _core.sum64(data) == 0xA74440EA7F0BDA9E
    assert _core.sum64(data[13:]) == 0xF9C40474B8E5037E
    assert _core.sum64(data[: 49152 * 4 + 1000]) == 0x0179B60500C270BE


# Every code path against an independent model of the algorithm, at any length and alignment:
# tests/native/test_sum64_oracle.py.


@settings(max_examples=150, deadline=None)
@given(data=st.binary(min_size=0, max_size=5000), cut=st.integers(0, 5000))
def test_crc_continues_and_paths_agree(data: bytes, cut: int) -> None:
    cut = min(cut, len(data))
    whole = _core.crc32c(data)
    assert _core.crc32c(data[cut:], _core.crc32c(data[:cut])) == whole
    assert _core.sum64(data) == sum64_model.sum64(data)
    _core._force_portable_checksum(PORTABLE)
    try:
        assert _core.crc32c(data) == whole
        assert _core.sum64(data) == sum64_model.sum64(data)
    finally:
        _core._force_portable_checksum(FASTEST)


def _raw_crc(crc: int, data: bytes) -> int:
    """CRC-32C without the pre/post inversions, as the piece checksum's lanes run."""
    return ~_core.crc32c(data, ~crc & 0xFFFFFFFF) & 0xFFFFFFFF


@settings(max_examples=100, deadline=None)
@given(
    crc=st.integers(0, 2**32 - 1),
    nbytes=st.one_of(st.integers(0, 300), st.integers(0, 200_000)),
    portable=st.booleans(),
)
def test_crc_shift_is_a_crc_over_zero_bytes(crc: int, nbytes: int, portable: bool) -> None:
    """The fused copy joins lanes of pieces run apart with this shift: it must be exact."""
    expected = _raw_crc(crc, bytes(nbytes))
    _core._force_portable_checksum(PORTABLE if portable else FASTEST)
    try:
        assert _core._crc32c_shift(crc, nbytes) == expected
    finally:
        _core._force_portable_checksum(FASTEST)


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(0, 20), columns=st.integers(0, 9), seed=st.integers(0, 2**64 - 1))
def test_xxh64_rows_hashes_each_row(rows: int, columns: int, seed: int) -> None:
    values = np.random.default_rng(rows * 10 + columns).integers(
        0, 2**64 - 1, (rows, columns), dtype=np.uint64, endpoint=True
    )
    expected = [xxhash.xxh64_intdigest(row.tobytes(), seed) for row in values]
    np.testing.assert_array_equal(_core.xxh64_rows(values, seed), np.array(expected, np.uint64))


@settings(max_examples=50, deadline=None)
@given(
    total_rows=st.integers(1, 12),
    blocks=st.integers(0, 9),
    picks=st.lists(st.integers(0, 11), max_size=8),
    seed=st.integers(0, 2**64 - 1),
)
def test_xxh64_gathered_hashes_the_picked_rows_per_block(
    total_rows: int, blocks: int, picks: list[int], seed: int
) -> None:
    """A block's checksum from a hashed job's digests (row-major, rows x blocks) equals
    xxh64_rows over the picked rows, transposed: what slot_checksums answers."""
    digests = np.random.default_rng(total_rows * 100 + blocks).integers(
        0, 2**64 - 1, total_rows * blocks, dtype=np.uint64, endpoint=True
    )
    rows = np.array([p % total_rows for p in picks], dtype=np.int64)
    expected = _core.xxh64_rows(
        np.ascontiguousarray(digests.reshape(total_rows, blocks)[rows].T), seed
    )
    np.testing.assert_array_equal(_core.xxh64_gathered(digests, rows, blocks, seed), expected)
    if blocks:
        with pytest.raises(ValueError, match="rows"):
            _core.xxh64_gathered(digests, np.array([total_rows], np.int64), blocks)


@settings(max_examples=100, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), seed=st.integers(0, 2**64 - 1))
def test_xxh64_matches_the_reference(data: bytes, seed: int) -> None:
    assert _core.xxh64(data, seed) == xxhash.xxh64_intdigest(data, seed)


def test_sum64_detects_single_bit_flips_and_swaps() -> None:
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, 10_000, dtype=np.uint8)
    base = _core.sum64(data)
    for position in rng.choice(len(data) * 8, 200, replace=False):
        flipped = data.copy()
        flipped[position // 8] ^= 1 << (position % 8)
        assert _core.sum64(flipped) != base
    swapped = data.copy()
    swapped[[0, 8]] = swapped[[8, 0]]  # two words of different lanes
    assert _core.sum64(swapped) != base
    assert _core.sum64(data[:-1]) != base  # the length counts


@pytest.mark.parametrize("dst_offset", [0, 8, 16, 24, 3])
@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize(
    "size", [4096, 20_000, 200_000], ids=["page-pieces", "one-stream", "four-streams"]
)
def test_fused_copy_checksums_equal_a_separate_pass(
    dst_offset: int, streaming: bool, size: int
) -> None:
    rng = np.random.default_rng(dst_offset)
    piece = size + dst_offset  # odd sizes: heads, 192-byte steps and tails all happen
    n = (STREAMING_JOB // piece + 2) if streaming else 5
    src = rng.integers(0, 256, n * piece + 64, dtype=np.uint8)
    dst = np.zeros(n * piece + 128, dtype=np.uint8)
    order = rng.permutation(n)
    table = np.array(
        [
            (
                src.ctypes.data + int(order[i]) * piece + 5,
                dst.ctypes.data + dst_offset + i * piece,
                piece,
            )
            for i in range(n)
        ],
        dtype=np.uint64,
    )
    engine = _core.CopyEngine(2)
    digests = engine.copy_hashed(table)
    np.testing.assert_array_equal(digests, engine.hash(table))
    for i in range(n):
        start = int(order[i]) * piece + 5
        expected = src[start : start + piece]
        np.testing.assert_array_equal(
            dst[dst_offset + i * piece : dst_offset + (i + 1) * piece], expected
        )
        assert digests[i] == _core.sum64(expected)


def test_fused_copy_of_mixed_lengths_and_alignments() -> None:
    """Segments are copied several at once only when their lengths agree and every destination
    is aligned; any mix must give each segment its own bytes and checksum."""
    rng = np.random.default_rng(11)
    lengths = rng.choice([4096, 4096, 4096, 8192, 300, 16_000], size=3000)
    lengths[:800] = 16_384  # long runs of one length, as KV pieces are
    offsets = np.concatenate([[0], np.cumsum(lengths + 16)])
    src = rng.integers(0, 256, int(offsets[-1]) + 64, dtype=np.uint8)
    dst = np.zeros(int(offsets[-1]) + 64, dtype=np.uint8)
    shift = np.where(rng.random(len(lengths)) < 0.05, 8, 0)  # a few destinations unaligned
    table = np.stack(
        [
            src.ctypes.data + offsets[:-1] + 3,
            dst.ctypes.data + offsets[:-1] + shift,
            lengths,
        ],
        axis=1,
    ).astype(np.uint64)
    assert lengths.sum() >= STREAMING_JOB
    digests = _core.CopyEngine(2).copy_hashed(table)
    for i in range(len(lengths)):
        a, n = int(offsets[i]), int(lengths[i])
        expected = src[a + 3 : a + 3 + n]
        got = dst[a + shift[i] : a + shift[i] + n]
        np.testing.assert_array_equal(got, expected)
        assert digests[i] == _core.sum64(expected)


@st.composite
def hashed_jobs(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]], bool]:
    """Segment tables for the fused copy: lengths from empty to 1 MiB, sources at any alignment,
    destinations mostly 8-byte aligned (the fast paths) with a few not; padded with one large
    segment to a streaming job or not."""
    n = draw(st.integers(1, 40))
    length = st.one_of(
        st.integers(0, 3000), st.integers(0, 70_000), st.sampled_from([4096, 16384, 131072])
    )
    same = draw(st.booleans())  # runs of one length, as KV pieces come, or mixed
    lengths = [draw(length)] * n if same else draw(st.lists(length, min_size=n, max_size=n))
    if draw(st.booleans()):
        lengths.append(draw(st.integers(1 << 20, 1 << 20 | 5000)))
    streaming = draw(st.booleans())
    if streaming and sum(lengths) < STREAMING_JOB:
        lengths.append(STREAMING_JOB - sum(lengths) + draw(st.integers(0, 1000)))
    rows, src_at, dst_at = [], 0, 0
    for size in lengths:
        src_at += draw(st.integers(0, 63))
        dst_at += draw(st.sampled_from([0, 8, 16, 24, 40, 56])) + draw(
            st.sampled_from([0] * 9 + [3])
        )
        rows.append((src_at, dst_at, size))
        src_at += size
        dst_at += size
    return max(src_at, dst_at) + 64, rows, streaming


@pytest.mark.parametrize(
    "path", [FASTEST, CLMUL128, CRC_INSTRUCTION], ids=["fastest", "clmul128", "crc-instruction"]
)
@settings(max_examples=25, deadline=None)
@given(job=hashed_jobs(), seed=st.integers(0, 2**32 - 1))
def test_fused_copy_checksums_every_segment(
    path: int, job: tuple[int, list[tuple[int, int, int]], bool], seed: int
) -> None:
    size, rows, _ = job
    src = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    table = np.array(
        [(src.ctypes.data + s, dst.ctypes.data + d, n) for s, d, n in rows], dtype=np.uint64
    )
    engine = _core.CopyEngine(2)
    digests = _on_path(path, engine.copy_hashed, table)
    hashes = _on_path(path, engine.hash, table)
    _core._force_portable_checksum(PORTABLE)
    try:
        expected = [_core.sum64(src[s : s + n]) for s, _, n in rows]
    finally:
        _core._force_portable_checksum(FASTEST)
    np.testing.assert_array_equal(digests, np.array(expected, dtype=np.uint64))
    np.testing.assert_array_equal(hashes, digests)
    for s, d, n in rows:
        np.testing.assert_array_equal(dst[d : d + n], src[s : s + n])
