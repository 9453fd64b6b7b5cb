"""The native batch file I/O under the disk tier (``_core.file_runs``): many runs of
``preadv``/``pwritev`` on C threads, over real files, with random data."""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpusync._native import core as _core
from tpusync._src.tiers.disk import pool as disk_pool
from tpusync.errors import InvalidArgumentError


def _runs(sizes: list[list[int]]) -> tuple[np.ndarray, ...]:
    """Runs of consecutive file bytes (each a list of buffer sizes), one after another."""
    offsets, firsts, counts, lengths = [], [], [], []
    at = 0
    for run in sizes:
        offsets.append(at)
        firsts.append(len(lengths))
        counts.append(len(run))
        lengths.extend(run)
        at += sum(run)
    return (
        np.array(offsets, np.int64),
        np.array(firsts, np.int32),
        np.array(counts, np.int32),
        np.array(lengths, np.uint64),
    )


@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.lists(st.integers(1, 70_000), min_size=1, max_size=9), min_size=1,
                   max_size=12),
    threads=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)  # fmt: skip
def test_reads_and_writes_every_run_exactly(
    tmp_path_factory: pytest.TempPathFactory, sizes: list[list[int]], threads: int, seed: int
) -> None:
    offsets, firsts, counts, lengths = _runs(sizes)
    total = int(lengths.sum())
    data = np.random.default_rng(seed).integers(0, 256, total, dtype=np.uint8)
    path = tmp_path_factory.mktemp("runs") / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        # the buffers lie scattered in memory: every other slice of a larger array
        spaced = np.zeros(2 * total + 64, np.uint8)
        starts = 2 * np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) + 7
        pieces = np.split(data, np.cumsum(lengths)[:-1])
        for start, length, piece in zip(starts, lengths, pieces, strict=True):
            spaced[start : start + int(length)] = piece
        addresses = (spaced.ctypes.data + starts).astype(np.uint64)
        fds = np.full(len(offsets), fd, np.int32)
        codes = _core.file_runs(fds, offsets, firsts, counts, addresses, lengths, True, threads,
                                True)  # fmt: skip
        assert not codes.any()
        assert path.read_bytes() == data.tobytes()
        spaced[:] = 0
        codes = _core.file_runs(fds, offsets, firsts, counts, addresses, lengths, False, threads,
                                False)  # fmt: skip
        assert not codes.any()
        got = np.concatenate([spaced[s : s + int(n)] for s, n in zip(starts, lengths, strict=True)])
        assert np.array_equal(got, data)
    finally:
        os.close(fd)


def test_a_run_past_the_end_or_on_a_bad_descriptor_fails_alone(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = np.random.default_rng(1).integers(0, 256, 8192, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        out = np.zeros(3 * 4096, np.uint8)
        base = out.ctypes.data
        codes = _core.file_runs(
            np.array([fd, fd, 999_999], np.int32), np.array([0, 8192, 0], np.int64),
            np.array([0, 1, 2], np.int32), np.ones(3, np.int32),
            np.array([base, base + 4096, base + 8192], np.uint64), np.full(3, 4096, np.uint64),
            False, 3, False,
        )  # fmt: skip
        assert codes.tolist() == [0, errno.EIO, errno.EBADF]
        assert np.array_equal(out[:4096], data[:4096])
        # a write that fails stops the runs after it: they fail as cancelled, not half done
        codes = _core.file_runs(
            np.array([999_999, fd], np.int32), np.zeros(2, np.int64), np.array([0, 1], np.int32),
            np.ones(2, np.int32), np.array([base, base], np.uint64), np.full(2, 16, np.uint64),
            True, 1, True,
        )  # fmt: skip
        assert codes.tolist() == [errno.EBADF, errno.ECANCELED]
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"first_iov": [1]}, "outside the 1 buffers"),
        ({"iov_counts": [0]}, "outside the 1 buffers"),
        ({"offsets": [-1]}, "outside the 1 buffers"),
        ({"fds": [3, 4]}, "equal lengths"),
        ({"lengths": [1, 2]}, "equal lengths"),
        ({"threads": 0}, "threads"),
        ({"lengths": [0]}, "buffer 0 has 0 bytes"),
        ({"first_iov": [2**31 - 1]}, "outside the 1 buffers"),
    ],
)
def test_bad_arguments_are_refused_before_any_io(change: dict, message: str) -> None:
    buffer = np.zeros(16, np.uint8)
    args = {
        "fds": [0], "offsets": [0], "first_iov": [0], "iov_counts": [1],
        "addresses": [buffer.ctypes.data], "lengths": [16], "write": False, "threads": 1,
        "stop_on_error": False,
    }  # fmt: skip
    args.update(change)
    with pytest.raises(InvalidArgumentError, match=message):
        _core.file_runs(**{k: np.array(v) if isinstance(v, list) else v for k, v in args.items()})


def test_the_disk_tiers_longest_run_fits_one_native_run() -> None:
    assert _core.MAX_IOVS_PER_RUN >= disk_pool._MAX_RUN_SLOTS


def test_populating_memory_the_kernel_refuses_leaves_it_alone() -> None:
    """``_core.populate_range`` (the vLLM connector's prefault) on read-only memory: no write,
    no crash; on writable memory every byte is kept."""
    readonly = mmap.mmap(-1, 1 << 20, prot=mmap.PROT_READ)
    view = np.frombuffer(readonly, np.uint8)
    _core.populate_range(view.ctypes.data, view.size)
    assert not view.any()
    del view
    readonly.close()
    data = np.random.default_rng(3).integers(0, 256, 3 << 20, dtype=np.uint8)
    before = data.copy()
    _core.populate_range(data.ctypes.data + 5, data.size - 9)
    assert np.array_equal(data, before)
