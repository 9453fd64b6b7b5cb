"""The native limits (tpusync._src.bench.limits, csrc/limits.c): every copy method copies every byte
of random data at any size and alignment, on any number of threads; the TCP limit moves what it
says; bad arguments are refused by name."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tools import require_tool

from tpusync._native import limits as native
from tpusync._src.bench.cores import SplitEnds
from tpusync._src.bench.limits import (
    NR_HUGEPAGES,
    TCP_SETTINGS,
    Iperf3PerStream,
    MemoryLimit,
    disk_fio,
    loopback_tcp,
    reserved_huge_pages,
)
from tpusync._src.memory.copy_limit import last_level_cache_bytes
from tpusync.errors import InvalidArgumentError

METHODS = sorted(native.COPY_METHODS)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("nbytes", [1, 63, 64, 4095, 4096, 16384 + 5, (1 << 20) + 123])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copy_methods_copy_every_byte(method: str, nbytes: int, threads: int) -> None:
    rng = np.random.default_rng(nbytes * 7 + threads)
    src = rng.integers(0, 256, size=nbytes + 7, dtype=np.uint8)
    dst = rng.integers(0, 256, size=nbytes + 7, dtype=np.uint8)
    guard = dst.copy()
    seconds = native.copy_seconds(dst[3 : 3 + nbytes], src[5 : 5 + nbytes], threads, method, 2)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    np.testing.assert_array_equal(dst[3 : 3 + nbytes], src[5 : 5 + nbytes])
    np.testing.assert_array_equal(dst[:3], guard[:3])  # nothing outside the slice is written
    np.testing.assert_array_equal(dst[3 + nbytes :], guard[3 + nbytes :])


@settings(max_examples=40, deadline=None)
@given(
    nbytes=st.integers(1, 300_000),
    src_offset=st.integers(0, 63),
    dst_offset=st.integers(0, 63),
    threads=st.integers(1, 4),
    method=st.sampled_from(METHODS),
)
def test_copy_is_exact_for_any_size_and_alignment(
    nbytes: int, src_offset: int, dst_offset: int, threads: int, method: str
) -> None:
    rng = np.random.default_rng(nbytes)
    src = rng.integers(0, 256, size=nbytes + 64, dtype=np.uint8)
    dst = np.zeros(nbytes + 64, dtype=np.uint8)
    native.copy_seconds(
        dst[dst_offset : dst_offset + nbytes], src[src_offset : src_offset + nbytes], threads,
        method, 1,
    )  # fmt: skip
    assert np.array_equal(
        dst[dst_offset : dst_offset + nbytes], src[src_offset : src_offset + nbytes]
    )
    assert not dst[:dst_offset].any() and not dst[dst_offset + nbytes :].any()


def test_a_cold_limit_empties_the_caches_before_each_copy() -> None:
    """A region that fits in the last-level cache: copied back to back, the source comes from
    the cache; with the caches emptied before each copy it cannot, so the cold limit is lower."""
    nbytes = min(4 << 20, last_level_cache_bytes() // 4)
    warm, cold = MemoryLimit(nbytes, threads=1), MemoryLimit(nbytes, threads=1, cold=True)
    try:
        assert warm._evict is None and cold._evict is not None
        assert cold._evict.nbytes >= 4 * last_level_cache_bytes()
        for _ in range(5):
            warm.sample(repeats=3)
            cold.sample(repeats=3)
        assert cold.verify()
        assert cold.result().gbps < warm.result().gbps
    finally:
        warm.close()
        cold.close()


def test_memory_limit_reports_every_method_and_copies_right() -> None:
    limit = MemoryLimit(4 << 20, threads=2)
    try:
        for _ in range(3):
            limit.sample()
        assert limit.verify()
        result = limit.result()
        assert set(result.gbps_by_method) == set(limit.methods)
        assert "np.copyto" not in result.gbps_by_method  # shown beside, never the limit
        assert result.gbps == max(result.gbps_by_method.values()) > 0
        assert limit.copyto_gbps() > 0
        assert len(result.runs["memcpy"]) == 3
    finally:
        limit.close()


def test_loopback_tcp_times_every_setting_on_every_repeat() -> None:
    result = loopback_tcp(2, 8 << 20, repeats=2)
    assert len(result.gbps_by_method) == len(TCP_SETTINGS)
    assert "chunk=4M,sndbuf=auto,lowat=256K" in result.gbps_by_method
    assert all(g > 0 for g in result.gbps_by_method.values())
    assert all(len(r) == 2 for r in result.runs.values())


def test_a_low_mark_above_what_the_window_holds_still_finishes() -> None:
    """SO_RCVLOWAT far above a small send buffer: the receiver must not wait for a mark the
    window can never fill (it reads again after a short poll)."""
    start = time.monotonic()
    seconds = native.tcp_seconds(1, 4 << 20, 0, 1 << 20, 64 << 10, 2, 16 << 20)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)
    assert time.monotonic() - start < 20


def test_the_tcp_ends_can_each_be_pinned_to_a_cpu() -> None:
    ends = SplitEnds.here()
    assert ends is not None, "this test needs two CPUs"
    result = loopback_tcp(1, 4 << 20, repeats=1, ends=ends)
    assert all(g > 0 for g in result.gbps_by_method.values())
    # the pinning is applied, not ignored: a CPU this machine lacks fails the run
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(OSError):
        native.tcp_seconds(1, 1 << 20, 0, 1 << 16, 0, 1, 0, missing, ends.receiver)


def _copy(dst_size: int, src_size: int, threads: int = 1, method: str = "memcpy") -> None:
    native.copy_seconds(
        np.ones(dst_size, np.uint8), np.ones(src_size, np.uint8), threads, method, 1
    )


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: _copy(8, 9), "dst, src"),
        (lambda: _copy(8, 8, method="fast"), "method"),
        (lambda: _copy(8, 8, threads=0), "threads"),
        (lambda: native.tcp_seconds(0, 1, 0, 1, 0, 1), "streams"),
        (lambda: native.tcp_seconds(1, 1, 0, 1, 0, 1, 0, -2), "sender_cpu, receiver_cpu"),
        (lambda: MemoryLimit(0), "nbytes"),
        (lambda: MemoryLimit(True), "nbytes"),
    ],
)
def test_bad_arguments_are_refused_by_name(call, argument: str) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^{argument}\b"):
        call()


def test_result_before_any_sample_is_refused() -> None:
    limit = MemoryLimit(4096)
    try:
        with pytest.raises(InvalidArgumentError, match="sample"):
            limit.result()
    finally:
        limit.close()


def test_disk_fio_runs_each_iodepth_with_the_jobs_asked_and_leaves_nothing(tmp_path) -> None:
    require_tool("fio", "fio")
    with open(NR_HUGEPAGES) as f:
        before = f.read()
    result = disk_fio(str(tmp_path), 8 << 20, 1 << 20, "write", numjobs=2, iodepths=(1, 4))
    assert result is not None
    assert [label.split(",")[0] for label in result.gbps_by_method] == ["iodepth=1", "iodepth=4"]
    assert all(g > 0 for g in result.gbps_by_method.values())
    assert list(tmp_path.iterdir()) == []  # fio's files are removed
    with open(NR_HUGEPAGES) as f:
        assert f.read() == before  # the huge-page setting is given back


def test_reserved_huge_pages_gives_the_setting_back() -> None:
    with open(NR_HUGEPAGES) as f:
        before = int(f.read())
    with reserved_huge_pages(4 << 20) as reserved:
        with open(NR_HUGEPAGES) as f:
            during = int(f.read())
        assert reserved == (os.geteuid() == 0)  # root may reserve them (CI runs as root)
        if reserved:
            assert during >= before + 2
    with open(NR_HUGEPAGES) as f:
        assert int(f.read()) == before


def test_iperf3_per_stream_runs_one_client_per_stream() -> None:
    require_tool("iperf3", "iperf3")
    with Iperf3PerStream(2) as iperf:
        assert len(iperf.ports) == 2 and len(set(iperf.ports)) == 2
        assert iperf.gbps(16 << 20) > 0
        ends = SplitEnds.here()
        assert ends is not None, "this test needs two CPUs"
        assert iperf.gbps(16 << 20, ends=ends) > 0
        # the ends' CPUs reach iperf3 (-A): one this machine lacks fails the run
        with pytest.raises(RuntimeError, match="iperf3 failed"):
            iperf.gbps(1 << 20, tries=1, ends=SplitEnds(max(os.sched_getaffinity(0)) + 1, 0))
        servers = list(iperf._servers)
    assert all(server.poll() is not None for server in servers)  # stopped by pid


def test_disk_fio_refuses_an_unknown_rw(tmp_path) -> None:
    require_tool("fio", "fio")
    with pytest.raises(InvalidArgumentError, match=r"^rw\b"):
        disk_fio(str(tmp_path), 1 << 20, 1 << 20, "randrw", numjobs=1)
