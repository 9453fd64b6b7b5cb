"""Huge pages behind host memory: collapsing never changes a byte, and CPU pools get them."""

from __future__ import annotations

import os
import platform
import threading

import jax
import numpy as np
import pytest
from tools import tools_required

import tpusync
from tpusync import options
from tpusync._native import core as _core
from tpusync._src.memory import huge_pages

HUGE = 2 << 20


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def _kernel_at_least(major: int, minor: int) -> bool:
    numbers = platform.release().split("-")[0].split(".")
    return (int(numbers[0]), int(numbers[1])) >= (major, minor)


# MADV_COLLAPSE exists from Linux 6.1 and works unless THP is off
COLLAPSES = _thp_mode() in ("always", "madvise") and _kernel_at_least(6, 1)


def test_collapse_keeps_every_byte_while_a_thread_writes(rng):
    mapping = _core.Mapping(8 * HUGE + 4096)  # page-aligned, not huge-page aligned
    data = np.frombuffer(mapping, dtype=np.uint8)
    data[:] = rng.integers(0, 256, data.size, dtype=np.uint8)
    stop = threading.Event()
    writes = []

    def write(target: np.ndarray) -> None:  # its stores must all survive the collapse
        i = 0
        while not stop.is_set():
            at = (i * 1_000_003) % target.size
            target[at] ^= 0x5A
            writes.append(at)
            i += 1

    expected = data.copy()
    writer = threading.Thread(target=write, args=(data,))
    writer.start()
    try:
        done = _core.collapse_huge_pages(mapping.address, mapping.size)
    finally:
        stop.set()
        writer.join(timeout=10)
    for at in writes:
        expected[at] ^= 0x5A
    assert np.array_equal(data, expected)
    if COLLAPSES:
        # the whole huge pages inside: 7 or 8 of them, by where the mapping starts
        assert done in (7 * HUGE, 8 * HUGE)
    else:
        assert done <= 0
    del data, writer
    mapping.close()


def test_collapse_of_a_range_without_a_whole_huge_page_does_nothing():
    mapping = _core.Mapping(HUGE)
    start = mapping.address + 4096  # one page in: never a whole aligned 2 MiB inside
    assert _core.collapse_huge_pages(start, HUGE - 4096) == 0
    assert _core.collapse_huge_pages(mapping.address, 0) == 0
    mapping.close()


@pytest.mark.skipif(
    not COLLAPSES and not tools_required(), reason="needs Linux >= 6.1 with THP not 'never'"
)
def test_cpu_device_pool_is_collapsed_in_the_background_with_its_bytes_intact(arrays, rng):
    before = huge_pages.collapsed_bytes
    host = arrays.random(rng, (512, 16384), np.uint16)  # 16 MiB
    pool = tpusync.DevicePool(jax.device_put(host))
    assert huge_pages.wait_until_idle(timeout_s=20)
    assert huge_pages.collapsed_bytes - before >= 7 * HUGE  # 16 MiB: at least 7 of 8 pages
    np.testing.assert_array_equal(np.asarray(pool.array), host)


def test_huge_pages_can_be_turned_off(arrays, rng):
    with options.overridden(huge_pages=False):
        assert not huge_pages.enabled()
        queued = huge_pages._queue.qsize()
        tpusync.DevicePool(jax.device_put(arrays.random(rng, (1024, 4096), np.float32)))
        assert huge_pages._queue.qsize() == queued
    assert huge_pages.enabled()


def _shmem_collapses() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return COLLAPSES and "[deny]" not in f.read()
    except OSError:
        return False


def _pmd_mapped_kib(path: str) -> int:
    """KiB of ``path``'s mappings in this process that are mapped by huge pages (found by
    inode: a pool created under a temporary name keeps that name in /proc)."""
    inode = str(os.stat(path).st_ino)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0]:  # a mapping's first line: range perms offset dev inode path
                inside = len(fields) > 4 and fields[4] == inode
            elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
                total += int(line.split()[1])
    return total


def test_a_huge_pages_mapping_starts_on_a_huge_page_boundary(rng, shm_names):
    anonymous = _core.Mapping(5 * HUGE + 4096, huge_pages=True)
    assert anonymous.address % HUGE == 0 and anonymous.size == 5 * HUGE + 4096
    from tpusync._src.tiers.dram import pool_path

    path = pool_path(shm_names())
    with open(path, "wb") as f:
        f.truncate(3 * HUGE)
    fd = os.open(path, os.O_RDWR)
    try:
        shared = _core.Mapping(3 * HUGE, huge_pages=True, fd=fd)
        assert shared.address % HUGE == 0
        data = rng.integers(0, 256, 3 * HUGE, dtype=np.uint8)
        np.frombuffer(shared, np.uint8)[:] = data
        assert path.read_bytes() == data.tobytes()  # the file's pages, from offset 0
        shared.close()
    finally:
        os.close(fd)
    np.frombuffer(anonymous, np.uint8)[-1] = 7  # the last page is mapped, writable
    anonymous.close()


@pytest.mark.skipif(
    not _shmem_collapses() and not tools_required(),
    reason="needs MADV_COLLAPSE of shmem (Linux >= 6.1)",
)
def test_named_host_pool_gets_huge_pages_that_a_restart_maps(arrays, rng, shm_names):
    from tpusync.tiers import HostPool, PoolLayout

    host = arrays.random(rng, (16, 512, 1024), np.uint16)  # 16 blocks of 1 MiB
    source = tpusync.DevicePool(jax.device_put(host))
    layout = PoolLayout.from_pools("huge", [source])
    name = shm_names()
    keys = [bytes([i]) * 8 for i in range(16)]
    pool = HostPool(layout, 16, name=name)
    pool.put_from_device(keys, [source], np.arange(16))
    path = str(pool.path)
    assert huge_pages.wait_until_idle(timeout_s=20)
    assert _pmd_mapped_kib(path) >= 4 * HUGE // 1024  # the 16 MiB slots: most of them huge
    pool.close()
    again = HostPool(layout, 16, name=name)  # a restart re-attaches the same file
    assert again.attached and again.wait_mapped(timeout=20)
    assert huge_pages.wait_until_idle(timeout_s=20)
    assert _pmd_mapped_kib(path) >= 4 * HUGE // 1024
    target = tpusync.DevicePool(jax.device_put(np.zeros_like(host)))
    again.get_to_device(keys[::-1], [target], np.arange(16))
    np.testing.assert_array_equal(np.asarray(target.array), host[::-1])
    again.close()


def test_a_closed_named_pool_reopens_at_once_while_its_pages_are_collapsed(shm_names):
    """close() releases ownership at once, even while the background collapse still holds the
    pool's file (flock belongs to the open file, which a mapping keeps alive): reopening a
    128 MiB pool right after closing it is an attach, never a PoolBusyError."""
    from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

    layout = PoolLayout("reopen", (ArrayLayout("k", "uint8", (1 << 20,), 0, 1),))
    name = shm_names()
    HostPool(layout, 128, name=name, populate=False).close()  # queues its collapse
    for _ in range(3):
        pool = HostPool(layout, 128, name=name, populate=False)
        assert pool.attached
        pool.close()
    assert huge_pages.wait_until_idle(timeout_s=30)


@pytest.mark.skipif(
    not _shmem_collapses() and not tools_required(),
    reason="needs MADV_COLLAPSE of shmem (Linux >= 6.1): else no pool's pages are collapsed",
)
def test_a_named_pool_made_with_collapse_false_keeps_small_pages(rng, shm_names):
    """The weights publisher's pool opts out: no collapse is queued, no page of the file is
    mapped huge (samplers read a collapsed pool through small pages up to 2.4x slower)."""
    from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

    layout = PoolLayout("small", (ArrayLayout("k", "uint8", (1 << 20,), 0, 1),))
    assert huge_pages.wait_until_idle(timeout_s=20)
    before = huge_pages.collapsed_bytes
    pool = HostPool(layout, 16, name=shm_names(), collapse=False)
    view = pool.views()[0]
    view[...] = rng.integers(0, 256, size=view.shape, dtype=np.uint8)
    del view
    assert huge_pages.wait_until_idle(timeout_s=20)
    assert huge_pages.collapsed_bytes == before
    assert _pmd_mapped_kib(str(pool.path)) == 0
    pool.close()
