"""The native piece checksum (sum64) against an oracle that is not its own output: the plain
Python model of format 1 in tests/helpers/sum64_model.py, written from the documented algorithm
(docs/decisions/0002-fused-checksum.md, "format 1 exactly"). Every code path (AVX-512
carry-less multiplication, the CRC instruction alone, the portable tables), every length class
the kernels treat apart, every alignment, and the incremental and many-region entry points."""

from __future__ import annotations

import hashlib
import itertools
import mmap

import numpy as np
import pytest
import sum64_model
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core

# The checksum's code paths (_core._force_portable_checksum): 0 the fastest the CPU has, 3 the
# 128-bit carry-less multiplication, 2 the CRC instruction only, 1 the portable tables.
FASTEST, PORTABLE, CRC_INSTRUCTION, CLMUL128 = 0, 1, 2, 3
PATHS = (FASTEST, CLMUL128, CRC_INSTRUCTION, PORTABLE)
PAGE = mmap.PAGESIZE


def _native_on_every_path(data: object) -> list[int]:
    """sum64 of `data` computed by each kernel in turn."""
    digests = []
    try:
        for path in PATHS:
            _core._force_portable_checksum(path)
            digests.append(_core.sum64(data))
    finally:
        _core._force_portable_checksum(FASTEST)
    return digests


def _fixed_bytes(n: int) -> bytes:
    """Bytes that look random and never change with a library version (SHAKE-256 of a label)."""
    return hashlib.shake_256(b"tpusync sum64 known answers").digest(n)


def _page_aligned(rng: np.random.Generator, size: int) -> np.ndarray:
    """`size` random bytes starting on a page boundary, so that offsets from it are exact."""
    buffer = rng.integers(0, 256, size + PAGE, dtype=np.uint8)
    start = -buffer.ctypes.data % PAGE
    return buffer[start : start + size]


def test_model_crc32c_is_the_standard_crc32c(rng: np.random.Generator) -> None:
    """The model's CRC stands on its own: the published check value, then the native CRC."""
    assert sum64_model.crc32c(b"123456789") == 0xE3069283
    assert sum64_model.crc32c(b"") == 0
    for n in (1, 7, 8, 9, 100, 4099):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert _core.crc32c(data) == sum64_model.crc32c(data)


def test_model_splits_words_into_lanes() -> None:
    """Word i feeds lane i % 3 and the trailing bytes follow lane 0's words, as documented."""
    data = bytes(range(8 * 7 + 5))
    lane0, lane1, lane2 = sum64_model.lane_streams(data)
    words = [data[8 * i : 8 * i + 8] for i in range(7)]
    assert lane0 == words[0] + words[3] + words[6] + data[56:]
    assert lane1 == words[1] + words[4]
    assert lane2 == words[2] + words[5]


# Known answers computed by the model (tests/helpers/sum64_model.py) and written down, so that a
# change to the native code and the model together is still caught (b"tpusync" is also one of
# test_checksum.py's golden vectors, pinned from the native code before the model existed). An int n
# stands for _fixed_bytes(n).
KNOWN_ANSWERS = [
    (b"", 0x0000000000000000),
    (b"\x00", 0x383013003BB14B1D),
    (b"tpusync", 0xD56A606636FCBA1C),
    (bytes(range(256)), 0xDBD1617C1DD4B03E),
    (7, 0x1D2DA23747C68854),
    (8, 0x0892A389230F6B97),
    (9, 0xA81F1793D77F6DCD),
    (23, 0xD2EA4547FD93D6DC),
    (24, 0x45C547DB24055378),
    (25, 0xFC08C9C002C2C0D6),
    (4096 + 5, 0xF05E318E2C0BC246),
    (49152 * 4 + 1000, 0x09EBDAE516D22B10),
    ((1 << 20) + 3, 0x7497F8E10E7AC9CB),
]


@pytest.mark.parametrize(
    ("data", "expected"),
    KNOWN_ANSWERS,
    ids=[str(d) if isinstance(d, int) else f"bytes{len(d)}" for d, _ in KNOWN_ANSWERS],
)
def test_sum64_known_answers(data: bytes | int, expected: int) -> None:
    if isinstance(data, int):
        data = _fixed_bytes(data)
    assert sum64_model.sum64(data) == expected
    assert _native_on_every_path(data) == [expected] * len(PATHS)


# Lengths around every boundary the kernels treat apart: the 8-byte word, the 24-byte lane
# group, the 192-byte block of the CRC-instruction path, a page, the four-stream sizes
# (4 x 12, 6, 3, 1.5 KiB), 1 MiB and several MiB.
LENGTHS = sorted(
    {0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 23, 24, 25, 31, 47, 48, 49, 63, 64, 65, 191, 192, 193}
    | {383, 384, 385, 1000, 4095, 4096, 4097, 8191, 8192, 8193, 6143, 6144 * 4 + 7}
    | {12288 * 4 - 1, 12288 * 4, 12288 * 4 + 1, 12288 * 12 + 191, 65537, 200_003}
)
BIG_LENGTHS = [(1 << 20) + 1, (3 << 20) + 5, (4 << 20) + 77]


@pytest.mark.parametrize("length", LENGTHS)
def test_sum64_matches_the_model_at_every_length_and_offset(
    rng: np.random.Generator, length: int
) -> None:
    buffer = rng.integers(0, 256, length + 64, dtype=np.uint8)
    for offset in (0, 1, 3, 7, 8, 13, 63):
        data = buffer[offset : offset + length]
        expected = sum64_model.sum64(data)
        assert _native_on_every_path(data) == [expected] * len(PATHS), (length, offset)


@pytest.mark.parametrize("length", BIG_LENGTHS, ids=lambda n: f"{n / (1 << 20):.1f}MiB")
def test_sum64_matches_the_model_on_several_mib(rng: np.random.Generator, length: int) -> None:
    buffer = rng.integers(0, 256, length + 64, dtype=np.uint8)
    for offset in (0, 5):
        data = buffer[offset : offset + length]
        assert _native_on_every_path(data) == [sum64_model.sum64(data)] * len(PATHS)


@pytest.mark.parametrize("start", [0, 1, 8, PAGE - 24, PAGE - 7, PAGE - 1, PAGE + 3])
@pytest.mark.parametrize("length", [24, 100, PAGE, PAGE + 1, 3 * PAGE - 5])
def test_sum64_matches_the_model_across_page_boundaries(
    rng: np.random.Generator, start: int, length: int
) -> None:
    data = _page_aligned(rng, 5 * PAGE)[start : start + length]
    assert _native_on_every_path(data) == [sum64_model.sum64(data)] * len(PATHS)


@settings(max_examples=60, deadline=None)
@given(
    length=st.one_of(
        st.integers(0, 4000),
        st.integers(0, 200_000),
        st.integers(0, 3 << 20),
        # around the four-stream sizes (4 x 12, 6, 3, 1.5 KiB) and the 192-byte blocks
        st.builds(
            lambda s, m, r: 4 * s * m + r,
            st.sampled_from([12288, 6144, 3072, 1536]),
            st.integers(1, 3),
            st.integers(-200, 200),
        ).filter(lambda n: n >= 0),
    ),
    offset=st.integers(0, 63),
    seed=st.integers(0, 2**32 - 1),
)
def test_sum64_matches_the_model_on_every_path(length: int, offset: int, seed: int) -> None:
    """Any length and alignment, on every kernel: the model's value."""
    buffer = np.random.default_rng(seed).integers(0, 256, length + 64, dtype=np.uint8)
    data = buffer[offset : offset + length]
    assert _native_on_every_path(data) == [sum64_model.sum64(data)] * len(PATHS)


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=3000),  # a piece of no bytes is never fed
    cuts=st.lists(st.integers(0, 3000), max_size=8),
    path=st.sampled_from(PATHS),
)
def test_sum64_fed_in_any_pieces_matches_the_model(data: bytes, cuts: list[int], path: int) -> None:
    """The incremental form (PieceHasher feeds tps_sum64_update): any split, the same value."""
    bounds = sorted({0, len(data), *(min(c, len(data)) for c in cuts)})
    hasher = _core.PieceHasher(np.array([0]), np.array([len(data)]))
    _core._force_portable_checksum(path)
    try:
        for lo, hi in itertools.pairwise(bounds):
            hasher.feed(data[lo:hi])
    finally:
        _core._force_portable_checksum(FASTEST)
    assert hasher.complete
    assert int(hasher.digests[0]) == sum64_model.sum64(data)


def test_sum64_regions_match_the_model(rng: np.random.Generator) -> None:
    """The many-region entry point (the DRAM tier's verify): each region its model value."""
    buffer = rng.integers(0, 256, 300_000, dtype=np.uint8)
    lengths = np.array([0, 1, 9, 24, 4096, 4097, 12288 * 4 + 5, 100_001], dtype=np.uint64)
    starts = np.array([0, 3, 17, 100, 1000, 5003, 20_000, 150_000], dtype=np.uint64)
    digests = _core.sum64_regions(starts + np.uint64(buffer.ctypes.data), lengths)
    expected = [
        sum64_model.sum64(buffer[int(s) : int(s) + int(n)])
        for s, n in zip(starts, lengths, strict=True)
    ]
    np.testing.assert_array_equal(digests, np.array(expected, dtype=np.uint64))


def test_copy_engine_checksums_match_the_model(rng: np.random.Generator) -> None:
    """The fused copy and the separate hash pass, against the model (not against sum64)."""
    lengths = [0, 7, 24, 4096, 4096, 4096, 4096, 16_384, 50_001]
    src = rng.integers(0, 256, sum(lengths) + 64 * len(lengths), dtype=np.uint8)
    dst = np.zeros_like(src)
    rows, at = [], 0
    for n in lengths:
        rows.append((src.ctypes.data + at + 3, dst.ctypes.data + at, n))
        at += n + 64
    table = np.array(rows, dtype=np.uint64)
    engine = _core.CopyEngine(2)
    expected = np.array(
        [sum64_model.sum64(src[s - src.ctypes.data : s - src.ctypes.data + n]) for s, _, n in rows],
        dtype=np.uint64,
    )
    np.testing.assert_array_equal(engine.hash(table), expected)
    np.testing.assert_array_equal(engine.copy_hashed(table), expected)
