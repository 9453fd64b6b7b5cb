"""DiskPool, the local-SSD tier: round trips with exact bits, restarts (also from a real second
process), torn and corrupt blocks, damaged files, a full filesystem (a real tiny tmpfs), I/O
errors, direct and buffered I/O, both durability settings, bad input, and real SIGKILLs.

Most tests fill DRAM slots directly through the slot interface (``reserve`` / ``slot_memory`` /
``commit``) with bytes that are a function of the key (:func:`expected`), so any block served can
be checked; one round trip goes from device arrays and back to fresh ones.

The cross-process tests run tests/helpers/disk_pool_child.py, which holds the block contents.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from disk_pool_child import (
    CAPACITY,
    SLAB_SLOTS,
    check,
    expected,
    fill,
    key_for,
    load_and_check,
    make_layout,
)
from paths import HELPERS
from tools import skip_or_fail

from tpusync._native import core as _core
from tpusync._src.info import check_o_direct
from tpusync._src.tiers.disk import _io_jobs as disk_io_jobs
from tpusync._src.tiers.disk import pool as disk_pool_module
from tpusync._src.tiers.dram.pool_file import COMMITTED, RECORD_DTYPE, WRITING
from tpusync.errors import (
    BlocksMissingError,
    InvalidArgumentError,
    PoolBusyError,
    PoolFormatError,
    TierFullError,
    TpuSyncError,
    TransferFailedError,
)
from tpusync.tiers import DiskPool, HostPool, LowerTier, PoolLayout

PAGE = 4096
CHILD = HELPERS / "disk_pool_child.py"
KILLS = 8  # each kill costs a child start (about 1 s plus JAX's import)


def open_pool(directory: Path, layout: PoolLayout | None = None, **kwargs) -> DiskPool:
    kwargs.setdefault("slab_slots", SLAB_SLOTS)
    return DiskPool(layout or make_layout(), kwargs.pop("capacity", CAPACITY), directory, **kwargs)


def on_disk(directory: Path, key: bytes, layout: PoolLayout) -> tuple[Path, int]:
    """The slab file and byte offset of ``key``'s payload, read from the index file as the
    module docstring describes the format (independently of the pool's own code)."""
    data = (directory / "tpusync-disk.index").read_bytes()
    records = np.frombuffer(data, RECORD_DTYPE, offset=PAGE)
    for slot, record in enumerate(records):
        if record["state"] == COMMITTED and bytes(record["key"])[: record["key_len"]] == key:
            slab, within = divmod(slot, SLAB_SLOTS)
            return directory / f"slab-{slab:06d}.tpd", PAGE + within * layout.slot_bytes
    raise AssertionError(f"{key.hex()} has no committed record")


@pytest.fixture
def layout() -> PoolLayout:
    return make_layout()


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    path = tmp_path / "disk"
    path.mkdir()
    return path


@pytest.fixture
def source(layout: PoolLayout) -> Iterator[HostPool]:
    with HostPool(layout, CAPACITY) as host:
        yield host


KEYS = [key_for(i) for i in range(24)]


# --- round trips ----------------------------------------------------------------------------------


def _direct_modes(directory: Path) -> list[bool]:
    return [True, False] if check_o_direct(str(directory))[0] else [False]


@pytest.mark.parametrize("durability", ["commit", "none"])
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_round_trip_dram_disk_dram(
    directory: Path, source: HostPool, layout: PoolLayout, durability: str, direct: bool
) -> None:
    if direct and not check_o_direct(str(directory))[0]:
        skip_or_fail("no O_DIRECT in the temporary directory")
    fill(source, KEYS)
    with open_pool(directory, durability=durability, direct_io=direct) as disk:
        assert disk.direct_io is direct
        assert disk.durability == durability
        assert disk.put(KEYS, source) == len(KEYS)
        assert disk.put(KEYS, source) == 0  # already stored: skipped
        assert disk.used == len(KEYS) and disk.free == CAPACITY - len(KEYS)
        assert disk.keys() == KEYS  # oldest commit first
        assert disk.stats.puts == len(KEYS)
        assert disk.stats.bytes_in == len(KEYS) * layout.payload_bytes
        assert source.used == len(KEYS)  # the source is untouched, and unpinned
        assert source.delete(KEYS) == len(KEYS)
        load_and_check(disk, KEYS)
        assert disk.stats.hits == len(KEYS) and disk.stats.misses == 0
        assert disk.stats.bytes_out == len(KEYS) * layout.payload_bytes


def _slab_fd_flags(directory: Path) -> list[int]:
    """The open flags of this process's descriptors of slab files in ``directory``."""
    flags = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)) and target.endswith(".tpd"):
            with open(f"/proc/self/fdinfo/{fd}") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            flags.append(int(fields["flags"].strip(), 8))
    return flags


def test_slab_files_are_opened_as_chosen(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:10])
    for direct in _direct_modes(directory):
        with open_pool(directory, direct_io=direct) as disk:
            disk.put(KEYS[:10], source)
            flags = _slab_fd_flags(directory)
            assert len(flags) == 2  # two slabs, each opened once
            assert all(bool(f & os.O_DIRECT) is direct for f in flags)
            load_and_check(disk, KEYS[:10])


def test_file_format_is_as_documented(directory: Path, source: HostPool, layout) -> None:
    """The version-1 format, parsed here by hand from the module docstring: a change of the
    format without a version bump fails this test."""
    import json
    import struct
    import zlib

    fill(source, KEYS[:3])
    with open_pool(directory, capacity=10) as disk:
        disk.put(KEYS[:3], source)
    checksums = source.hash_slots(np.array([source.slot_of(k) for k in KEYS[:3]]))
    index = (directory / "tpusync-disk.index").read_bytes()
    assert len(index) == PAGE + 10 * 64
    fixed = struct.Struct("<8sIIQQQ16s16sI")
    magic, version, header, slot_bytes, capacity, slab_slots, pool_id, fp, n = fixed.unpack_from(
        index
    )
    assert (magic, version, header) == (b"TPUSYNCI", 1, PAGE)
    assert (slot_bytes, capacity, slab_slots) == (layout.slot_bytes, 10, SLAB_SLOTS)
    assert fp == layout.fingerprint
    assert json.loads(index[fixed.size : fixed.size + n]) == layout.describe()
    assert struct.unpack_from("<I", index, PAGE - 4)[0] == zlib.crc32(index[: PAGE - 4])
    records = np.frombuffer(index, RECORD_DTYPE, offset=PAGE)
    assert records["state"].tolist() == [COMMITTED] * 3 + [0] * 7
    assert records["sequence"][:3].tolist() == [1, 2, 3]
    assert records["length"][:3].tolist() == [layout.payload_bytes] * 3
    assert records["checksum"][:3].tolist() == checksums.tolist()
    for slot, key in enumerate(KEYS[:3]):
        assert bytes(records["key"][slot])[: records["key_len"][slot]] == key
    slab = (directory / "slab-000000.tpd").read_bytes()
    assert len(slab) == PAGE + SLAB_SLOTS * layout.slot_bytes
    slab_fixed = struct.Struct("<8sIIQQQ16s16s")
    assert slab_fixed.unpack_from(slab) == (
        b"TPUSYNCS",
        1,
        PAGE,
        0,
        SLAB_SLOTS,
        layout.slot_bytes,
        pool_id,
        fp,
    )
    crc = struct.unpack_from("<I", slab, slab_fixed.size)[0]
    assert crc == zlib.crc32(slab[: slab_fixed.size])
    for slot, key in enumerate(KEYS[:3]):
        start = PAGE + slot * layout.slot_bytes
        payload = np.frombuffer(slab, np.uint8, layout.payload_bytes, start)
        assert np.array_equal(payload, expected(key, layout.payload_bytes))


def test_round_trip_from_device_to_fresh_device_exact_bits(
    directory: Path, rng: np.random.Generator, arrays
) -> None:
    """Device -> DRAM -> disk -> a new DRAM pool -> other device blocks, bit for bit (random
    bf16 bits with NaN payloads)."""
    import jax
    import ml_dtypes

    import tpusync

    n_blocks = 40
    shape = (n_blocks, 8, 256)
    originals = [arrays.random(rng, shape, ml_dtypes.bfloat16) for _ in range(3)]
    pools = [tpusync.DevicePool(jax.device_put(a)) for a in originals]
    layout = PoolLayout.from_pools("round-trip", pools, names=["k", "v", "w"])
    keys = [key_for(1000 + i) for i in range(n_blocks)]
    with HostPool(layout, n_blocks) as first:
        first.put_from_device(keys, pools, range(n_blocks))
        with DiskPool(layout, 64, directory, slab_slots=16) as disk:
            assert disk.put(keys, first) == n_blocks
    zeros = np.zeros(shape, ml_dtypes.bfloat16)
    targets = [tpusync.DevicePool(jax.device_put(zeros)) for _ in range(3)]
    order = rng.permutation(n_blocks)
    with DiskPool(layout, 64, directory, slab_slots=16) as disk, HostPool(layout, 48) as second:
        assert disk.attached
        disk.get(keys, second)
        second.get_to_device(keys, targets, order)
    for original, target in zip(originals, targets, strict=True):
        got = np.asarray(target.array)
        arrays.assert_same(got[order], original, "blocks after device->DRAM->disk->DRAM->device")


def test_is_a_lower_tier(directory: Path, layout: PoolLayout) -> None:
    with open_pool(directory) as disk:
        assert isinstance(disk, LowerTier)
        assert disk.capacity == CAPACITY and disk.used == 0 and len(disk) == 0
        assert "DiskPool(" in repr(disk)


def test_slab_files_are_created_as_needed(directory: Path, source: HostPool) -> None:
    fill(source, KEYS)
    with open_pool(directory) as disk:
        assert not list(directory.glob("slab-*"))
        disk.put(KEYS[:3], source)
        assert sorted(p.name for p in directory.glob("slab-*")) == ["slab-000000.tpd"]
        disk.put(KEYS[3:20], source)  # 20 blocks: three slabs of 8
        slabs = sorted(directory.glob("slab-*"))
        assert len(slabs) == 3
        for slab in slabs:
            assert slab.stat().st_size == PAGE + SLAB_SLOTS * disk.layout.slot_bytes


def test_last_slab_holds_the_remainder(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:10])
    with open_pool(directory, capacity=10) as disk:
        disk.put(KEYS[:10], source)
        assert (directory / "slab-000001.tpd").stat().st_size == PAGE + 2 * disk.layout.slot_bytes
    with open_pool(directory, capacity=10) as disk:
        assert disk.attached
        load_and_check(disk, KEYS[:10])


def test_delete_contains_keys(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:6])
    with open_pool(directory) as disk:
        disk.put(KEYS[:6], source)
        assert disk.contains([KEYS[0], KEYS[7], KEYS[5]]) == [True, False, True]
        assert disk.delete([KEYS[1], KEYS[1], KEYS[20]]) == 1
        assert disk.stats.deletes == 1
        assert disk.keys() == [KEYS[0], *KEYS[2:6]]
        assert disk.put(KEYS[:6], source) == 1  # only the deleted one is written again
        assert disk.keys() == [KEYS[0], *KEYS[2:6], KEYS[1]]
    with open_pool(directory) as disk:  # the order survives a restart
        assert disk.keys() == [KEYS[0], *KEYS[2:6], KEYS[1]]
        load_and_check(disk, KEYS[:6])


def test_get_partial_hits_and_keys_already_in_dram(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:4])
    with open_pool(directory) as disk, HostPool(disk.layout, 8) as target:
        disk.put(KEYS[:4], source)
        fill(target, [KEYS[0]])  # already in DRAM: counts as loaded, nothing read
        request = [KEYS[0], KEYS[9], KEYS[1], KEYS[1], KEYS[2]]
        with pytest.raises(BlocksMissingError) as info:
            disk.get(request, target)
        assert info.value.loaded == [True, False, True, True, True]
        assert info.value.corrupt == 0
        assert "1 absent" in str(info.value)
        assert isinstance(info.value, KeyError) and isinstance(info.value, TpuSyncError)
        check(target, [KEYS[0], KEYS[1], KEYS[2]])
        assert target.used == 3
        assert disk.stats.misses == 1


def test_concurrent_puts_and_gets(directory: Path, layout: PoolLayout) -> None:
    keys = [key_for(i) for i in range(CAPACITY)]
    with HostPool(layout, CAPACITY) as source, open_pool(directory) as disk:
        fill(source, keys)
        errors: list[BaseException] = []

        def writer(part: list[bytes]) -> None:
            try:
                for i in range(0, len(part), 3):
                    disk.put(part[i : i + 3], source)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(keys[i::3],)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert sorted(disk.keys()) == sorted(keys)
        with HostPool(layout, CAPACITY) as target:

            def reader(part: list[bytes]) -> None:
                try:
                    disk.get(part, target)
                except BaseException as exc:  # pragma: no cover - reported below
                    errors.append(exc)

            threads = [threading.Thread(target=reader, args=(keys[i::2],)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert not errors
            check(target, keys)


# --- restarts -------------------------------------------------------------------------------------


def test_restart_reattaches_and_serves(directory: Path, source: HostPool) -> None:
    fill(source, KEYS)
    with open_pool(directory) as disk:
        disk.put(KEYS, source)
        disk.delete(KEYS[:2])
    with open_pool(directory) as disk:
        assert disk.attached and disk.attach_seconds < 1.0
        assert disk.used == len(KEYS) - 2
        assert disk.contains(KEYS[:3]) == [False, False, True]
        load_and_check(disk, KEYS[2:])
        assert disk.stats.torn_discarded == 0


def test_second_process_is_refused_then_reattaches(directory: Path, source: HostPool) -> None:
    """A real second process: PoolBusyError while this one owns the pool; once closed, it
    re-attaches and verifies every block."""
    fill(source, KEYS)
    disk = open_pool(directory)
    try:
        disk.put(KEYS, source)
        child = subprocess.Popen(
            [sys.executable, str(CHILD), "verify", str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert child.stdin is not None and child.stdout is not None
        try:
            line = child.stdout.readline()
            assert line.startswith("busy:"), line
            assert f"pid {os.getpid()}" in line
            disk.close()
            child.stdin.write("go\n")
            child.stdin.flush()
            line = child.stdout.readline()
            assert line.strip() == f"verified {len(KEYS)}", line
            assert child.wait(timeout=30) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            child.stdin.close()
            child.stdout.close()
    finally:
        disk.close()


def test_busy_in_the_same_process(directory: Path) -> None:
    with open_pool(directory), pytest.raises(PoolBusyError, match="owned by a live process"):
        open_pool(directory)
    with open_pool(directory) as disk:  # released on close
        assert disk.attached


# --- torn, corrupt, damaged -----------------------------------------------------------------------


def test_torn_record_is_dropped_on_reopen(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:6])
    with open_pool(directory) as disk:
        disk.put(KEYS[:6], source)
    index = directory / "tpusync-disk.index"
    data = bytearray(index.read_bytes())
    records = np.frombuffer(data, RECORD_DTYPE, offset=PAGE)
    torn = int(np.flatnonzero(records["state"] == COMMITTED)[3])
    records["state"][torn] = WRITING  # as a crash between payload and commit leaves it
    torn_key = bytes(records["key"][torn])[: records["key_len"][torn]]
    index.write_bytes(bytes(data))
    with open_pool(directory) as disk:
        assert disk.stats.torn_discarded == 1
        assert not disk.contains([torn_key])[0]
        rest = [k for k in KEYS[:6] if k != torn_key]
        load_and_check(disk, rest)
        assert disk.put(KEYS[:6], source) == 1  # its slot is free again
    data = (directory / "tpusync-disk.index").read_bytes()
    assert not (np.frombuffer(data, RECORD_DTYPE, offset=PAGE)["state"] == WRITING).any()


def test_corrupt_payload_is_a_counted_miss(
    directory: Path, source: HostPool, layout: PoolLayout, caplog
) -> None:
    fill(source, KEYS[:8])
    with open_pool(directory) as disk, HostPool(layout, 8) as target:
        disk.put(KEYS[:8], source)
        slab, offset = on_disk(directory, KEYS[5], layout)
        with open(slab, "r+b") as f:  # flip bytes under the open pool
            f.seek(offset + 1000)
            byte = f.read(1)
            f.seek(offset + 1000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with (
            caplog.at_level(logging.WARNING, "tpusync.tiers"),
            pytest.raises(BlocksMissingError) as info,
        ):
            disk.get(KEYS[:8], target)
        assert info.value.loaded == [i != 5 for i in range(8)]
        assert info.value.corrupt == 1
        assert "1 failed their checksum" in str(info.value)
        assert "failed their checksum" in caplog.text
        assert disk.stats.checksum_failures == 1
        assert not disk.contains([KEYS[5]])[0]  # dropped from the disk pool
        assert not target.contains([KEYS[5]])[0]  # and never committed in DRAM
        assert target.used == 7 and target.free == 1  # its reserved slot was freed
        check(target, [k for i, k in enumerate(KEYS[:8]) if i != 5])


def test_padding_beyond_the_payload_is_not_checked(
    directory: Path, source: HostPool, layout: PoolLayout
) -> None:
    short = make_layout("short", rows=15)  # 30 KiB payload in a 32 KiB slot
    with HostPool(short, 4) as host, open_pool(directory, short) as disk:
        fill(host, KEYS[:2])
        disk.put(KEYS[:2], host)
        slab, offset = on_disk(directory, KEYS[1], short)
        with open(slab, "r+b") as f:
            f.seek(offset + short.payload_bytes + 7)
            f.write(b"\xff" * 100)
        load_and_check(disk, KEYS[:2])


def test_truncated_slab_drops_only_its_blocks(
    directory: Path, source: HostPool, layout: PoolLayout, caplog
) -> None:
    fill(source, KEYS[:12])
    with open_pool(directory) as disk:
        disk.put(KEYS[:12], source)  # slab 0 holds 8, slab 1 holds 4
    in_slab_1 = [k for k in KEYS[:12] if on_disk(directory, k, layout)[0].name.endswith("1.tpd")]
    assert len(in_slab_1) == 4
    slab0 = directory / "slab-000000.tpd"
    os.truncate(slab0, slab0.stat().st_size // 2)
    with pytest.raises(PoolFormatError, match="truncated"):
        open_pool(directory, on_mismatch="error")
    assert slab0.exists()  # "error" changes nothing
    with caplog.at_level(logging.WARNING, "tpusync.tiers"), open_pool(directory) as disk:
        assert "truncated" in caplog.text and "8 blocks are dropped" in caplog.text
        assert sorted(disk.keys()) == sorted(in_slab_1)
        load_and_check(disk, in_slab_1)
        assert disk.put(KEYS[:12], source) == 8  # slab 0 is recreated
        load_and_check(disk, KEYS[:12])


def test_missing_or_foreign_slab(directory: Path, source: HostPool, layout: PoolLayout) -> None:
    fill(source, KEYS[:12])
    with open_pool(directory) as disk:
        disk.put(KEYS[:12], source)
    (directory / "slab-000001.tpd").unlink()
    slab0 = directory / "slab-000000.tpd"
    with open(slab0, "r+b") as f:
        f.seek(40)
        f.write(b"\x00" * 16)  # the pool id: a slab of another pool
    with open_pool(directory) as disk:
        assert disk.used == 0
        assert disk.put(KEYS[:12], source) == 12
        load_and_check(disk, KEYS[:12])


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty", "bad-crc", "bad-version"])
def test_damaged_index_means_a_cold_start(
    directory: Path, source: HostPool, damage: str, caplog
) -> None:
    fill(source, KEYS[:10])
    with open_pool(directory) as disk:
        disk.put(KEYS[:10], source)
    index = directory / "tpusync-disk.index"
    data = bytearray(index.read_bytes())
    if damage == "garbage":
        data[:] = np.random.default_rng(0).integers(0, 256, len(data), np.uint8).tobytes()
    elif damage == "truncated":
        del data[PAGE + 100 :]
    elif damage == "empty":
        del data[:]
    elif damage == "bad-crc":
        data[200] ^= 1
    else:
        data[8] = 99
    index.write_bytes(bytes(data))
    with pytest.raises(PoolFormatError):
        open_pool(directory, on_mismatch="error")
    assert index.read_bytes() == bytes(data)  # "error" changes nothing
    with caplog.at_level(logging.WARNING, "tpusync.tiers"), open_pool(directory) as disk:
        assert not disk.attached and disk.used == 0
        assert "starting a cold pool" in caplog.text
        assert not list(directory.glob("slab-*"))
        assert disk.put(KEYS[:10], source) == 10
        load_and_check(disk, KEYS[:10])


def test_another_layout_or_geometry_means_a_cold_start(
    directory: Path, source: HostPool, caplog
) -> None:
    fill(source, KEYS[:4])
    with open_pool(directory) as disk:
        disk.put(KEYS[:4], source)
    other = make_layout("another-model")
    with pytest.raises(PoolFormatError, match="another layout"):
        open_pool(directory, other, on_mismatch="error")
    with pytest.raises(PoolFormatError, match="another layout"):
        open_pool(directory, capacity=CAPACITY + 1, on_mismatch="error")
    with open_pool(directory) as disk:  # untouched by the refusals
        assert disk.attached and disk.used == 4
    with caplog.at_level(logging.WARNING, "tpusync.tiers"), open_pool(directory, other) as disk:
        assert not disk.attached and disk.used == 0
    assert "another layout or geometry" in caplog.text and "cold pool" in caplog.text


# --- full, I/O errors -----------------------------------------------------------------------------


def test_full_pool_refuses_before_writing(directory: Path, layout: PoolLayout) -> None:
    keys = [key_for(i) for i in range(12)]
    with HostPool(layout, 12) as source, open_pool(directory, capacity=10) as disk:
        fill(source, keys)
        disk.put(keys[:8], source)
        with pytest.raises(TierFullError, match="4 new blocks but 2 free slots of 10"):
            disk.put(keys[8:], source)
        assert disk.used == 8 and disk.keys() == keys[:8]
        assert isinstance(TierFullError("x"), MemoryError)
        disk.delete(keys[:2])
        assert disk.put(keys[8:], source) == 4
        load_and_check(disk, disk.keys())


def test_source_lacking_keys_writes_nothing(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:3])
    with open_pool(directory) as disk:
        with pytest.raises(BlocksMissingError, match="not in the source pool") as info:
            disk.put([KEYS[0], KEYS[7], KEYS[1]], source)
        assert info.value.loaded == [True, False, True]
        assert disk.used == 0 and not list(directory.glob("slab-*"))
        assert source.delete(KEYS[:3]) == 3  # the source is not left pinned


def test_target_too_small_reads_nothing(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:6])
    with open_pool(directory) as disk, HostPool(disk.layout, 4) as target:
        disk.put(KEYS[:6], source)
        with pytest.raises(TierFullError):
            disk.get(KEYS[:6], target)
        assert target.used == 0 and target.free == 4
        assert disk.used == 6 and disk.delete(KEYS[:6]) == 6  # nothing left pinned


def runs_failing(real: Callable[..., np.ndarray], fails: Callable[..., tuple[int, int]]):
    """The native ``file_runs``, run by run, with faults: ``fails(write, offset, lengths)``
    says how many of a run's buffers really move first and the errno the run then fails with
    (0: none). A write stops at the first failure, as the real call does."""

    def file_runs(fds, offsets, firsts, counts, addresses, lengths, write, threads, stop):
        codes = np.zeros(len(fds), np.int32)
        for r in range(len(fds)):
            at = slice(int(firsts[r]), int(firsts[r]) + int(counts[r]))
            moved, code = fails(bool(write), int(offsets[r]), np.asarray(lengths[at]))
            if moved:
                done = real(
                    fds[r : r + 1], offsets[r : r + 1], np.zeros(1, np.int32),
                    np.array([moved], np.int32), addresses[at][:moved], lengths[at][:moved],
                    write, 1, stop,
                )  # fmt: skip
                code = code or int(done[0])
            codes[r] = code
            if code and stop:
                codes[r + 1 :] = errno.ECANCELED
                break
        return codes

    return file_runs


@pytest.mark.parametrize(
    ("code", "error"), [(errno.EIO, TransferFailedError), (errno.ENOSPC, TierFullError)]
)
def test_write_error_commits_nothing(
    directory: Path, source: HostPool, monkeypatch, code: int, error: type
) -> None:
    fill(source, KEYS[:12])
    with open_pool(directory) as disk:
        disk.put(KEYS[:4], source)
        real = _core.file_runs
        written = [0]  # blocks written before the failure

        def third_write_fails(write: bool, offset: int, lengths: np.ndarray) -> tuple[int, int]:
            if not write:
                return len(lengths), 0
            room = max(0, 2 - written[0])  # the third block of the put fails, after two
            written[0] += min(room, len(lengths))
            return min(room, len(lengths)), (code if len(lengths) > room else 0)

        monkeypatch.setattr(_core, "file_runs", runs_failing(real, third_write_fails))
        with pytest.raises(error) as info:
            disk.put(KEYS[4:12], source)
        assert isinstance(info.value.__cause__, OSError)
        assert os.strerror(code) in str(info.value)
        assert disk.keys() == KEYS[:4] and disk.free == CAPACITY - 4
        assert written[0]  # some blocks reached the disk before the failure
        monkeypatch.setattr(_core, "file_runs", real)
        load_and_check(disk, KEYS[:4])
        assert source.delete(KEYS[:12]) == 12  # unpinned
        fill(source, KEYS[:12])
        assert disk.put(KEYS[:12], source) == 8  # the slots are usable again
    with open_pool(directory) as disk:
        assert disk.stats.torn_discarded == 0
        load_and_check(disk, KEYS[:12])


def test_read_error_is_a_miss(
    directory: Path, source: HostPool, monkeypatch, layout: PoolLayout
) -> None:
    fill(source, KEYS[:6])
    with open_pool(directory) as disk, HostPool(layout, 6) as target:
        disk.put(KEYS[:6], source)
        _, bad_offset = on_disk(directory, KEYS[2], layout)

        def block_2_fails(write: bool, offset: int, lengths: np.ndarray) -> tuple[int, int]:
            if not write and offset <= bad_offset < offset + int(lengths.sum()):
                return 0, errno.EIO  # a run holding block 2 fails
            return len(lengths), 0

        monkeypatch.setattr(_core, "file_runs", runs_failing(_core.file_runs, block_2_fails))
        with pytest.raises(BlocksMissingError, match="1 unreadable") as info:
            disk.get(KEYS[:6], target)
        assert info.value.loaded == [i != 2 for i in range(6)]
        assert isinstance(info.value.__cause__, OSError)
        check(target, [k for i, k in enumerate(KEYS[:6]) if i != 2])
        assert target.free == 1
        assert not disk.contains([KEYS[2]])[0]


@contextlib.contextmanager
def mounted(fstype: str, where: Path, options: str = "") -> Iterator[Path]:
    if os.geteuid() != 0:
        skip_or_fail(f"mounting a {fstype} needs root")
    where.mkdir()
    command = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        skip_or_fail(f"cannot mount a {fstype}: {result.stderr.strip()}")
    try:
        os.chmod(where, 0o700)  # a fresh tmpfs is 1777: tiers refuse directories others may write
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_enospc_on_a_tiny_tmpfs(tmp_path: Path, layout: PoolLayout) -> None:
    """A real full filesystem: slabs of 132 KiB on a 512 KiB tmpfs. The slab that does not fit
    is a TierFullError naming the sizes; every block stored before still verifies, also after
    a restart; deleted blocks make room again."""
    keys = [key_for(i) for i in range(40)]
    with mounted("tmpfs", tmp_path / "mnt", "size=512k") as mnt:
        ok, _ = check_o_direct(str(mnt))
        with HostPool(layout, 40) as source:
            fill(source, keys)
            with DiskPool(layout, 40, mnt, slab_slots=4) as disk:
                assert disk.direct_io is ok  # "auto" follows what the filesystem allows
                stored = 0
                with pytest.raises(TierFullError) as info:
                    for i in range(0, 40, 2):
                        disk.put(keys[i : i + 2], source)
                        stored += 2
                assert 4 <= stored < 40
                message = str(info.value)
                assert "preallocating slab" in message and "MiB free of 0.5 MiB" in message
                assert disk.keys() == keys[:stored]
                load_and_check(disk, keys[:stored])
                assert not [p for p in mnt.iterdir() if ".tmp-" in p.name]  # cleaned up
                disk.delete(keys[:2])
                assert disk.put(keys[stored : stored + 2], source) == 2
            with DiskPool(layout, 40, mnt, slab_slots=4) as disk:
                assert disk.attached
                load_and_check(disk, keys[2 : stored + 2])


def test_buffered_fallback_where_o_direct_is_refused(tmp_path: Path, layout: PoolLayout) -> None:
    """ramfs refuses O_DIRECT (tmpfs accepts it since Linux 6.6): "auto" falls back to buffered
    I/O and says so; True is refused with the reason."""
    with mounted("ramfs", tmp_path / "ram") as ram:
        if check_o_direct(str(ram))[0]:
            skip_or_fail("this kernel's ramfs accepts O_DIRECT")
        with pytest.raises(InvalidArgumentError, match="O_DIRECT is not available"):
            DiskPool(layout, 8, ram, direct_io=True)
        with HostPool(layout, 8) as source, DiskPool(layout, 8, ram) as disk:
            assert disk.direct_io is False
            assert "unavailable" in disk.direct_io_reason
            fill(source, KEYS[:8])
            disk.put(KEYS[:8], source)
            load_and_check(disk, KEYS[:8])


def test_auto_falls_back_when_the_probe_says_no(
    directory: Path, source: HostPool, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(disk_io_jobs, "check_o_direct", lambda d: (False, "refused"))
    with caplog.at_level(logging.INFO, "tpusync.tiers"), open_pool(directory) as disk:
        assert disk.direct_io is False
        assert disk.direct_io_reason == "O_DIRECT unavailable: refused"
        fill(source, KEYS[:3])
        disk.put(KEYS[:3], source)
        load_and_check(disk, KEYS[:3])
    assert "buffered I/O" in caplog.text
    with open_pool(directory, direct_io=False) as disk:
        assert disk.direct_io is False and disk.direct_io_reason == "direct_io=False"


def test_flush_and_durability_none_survive_a_reopen(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:5])
    with open_pool(directory, durability="none") as disk:
        disk.put(KEYS[:5], source)
        disk.flush()
    with open_pool(directory, durability="commit") as disk:  # durability is not geometry
        assert disk.attached
        load_and_check(disk, KEYS[:5])


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -3}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"durability": "fast"}, "durability"),
        ({"direct_io": "yes"}, "direct_io"),
        ({"direct_io": 1}, "direct_io"),
        ({"slab_slots": 0}, "slab_slots"),
        ({"slab_slots": 1, "capacity": 10_000}, "slab_slots"),
        ({"on_mismatch": "ignore"}, "on_mismatch"),
        ({"io_threads": 0}, "io_threads"),
    ],
)
def test_bad_arguments(directory: Path, layout: PoolLayout, kwargs: dict, match: str) -> None:
    kwargs = {"capacity": 8, **kwargs}
    with pytest.raises(InvalidArgumentError, match=match):
        DiskPool(layout, kwargs.pop("capacity"), directory, **kwargs)
    assert not list(directory.iterdir())  # validated before touching the directory


def test_bad_layout_and_directory(tmp_path: Path, layout: PoolLayout) -> None:
    with pytest.raises(InvalidArgumentError, match="layout"):
        DiskPool("not a layout", 8, tmp_path)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        DiskPool(layout, 8, tmp_path / "missing")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match="not a directory"):
        DiskPool(layout, 8, tmp_path / "file")
    with pytest.raises(InvalidArgumentError, match="directory"):
        DiskPool(layout, 8, 42)  # type: ignore[arg-type]


def test_bad_keys_and_peers(directory: Path, source: HostPool) -> None:
    fill(source, KEYS[:2])
    with open_pool(directory) as disk, HostPool(make_layout("other"), 4) as other:
        for bad, match in [
            (["text"], r"keys\[0\]: expected bytes"),
            ([b""], r"keys\[0\]: 0 bytes"),
            ([KEYS[0], b"x" * 33], r"keys\[1\]: 33 bytes"),
        ]:
            for call in (disk.put, disk.get):
                with pytest.raises(InvalidArgumentError, match=match):
                    call(bad, source)
            with pytest.raises(InvalidArgumentError, match=match):
                disk.contains(bad)
            with pytest.raises(InvalidArgumentError, match=match):
                disk.delete(bad)
        with pytest.raises(InvalidArgumentError, match="source: expected a HostPool"):
            disk.put(KEYS[:1], object())  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="source: the HostPool holds another"):
            disk.put(KEYS[:1], other)
        with pytest.raises(InvalidArgumentError, match="target: the HostPool holds another"):
            disk.get(KEYS[:1], other)
        assert disk.put([bytearray(KEYS[0])], source) == 1  # any bytes-like key
        assert disk.put([], source) == 0
        disk.get([], source)
    with pytest.raises(InvalidArgumentError, match="closed"):
        disk.put(KEYS[:1], source)
    disk.close()  # twice is fine


# --- real crashes ---------------------------------------------------------------------------------


def _start_writer(directory: Path, durability: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, str(CHILD), "writer", str(directory), durability],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if line.strip() != "ready":
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        pytest.fail(f"the writer did not start (said {line!r}, exit {child.returncode})")
    return child


def test_sigkill_mid_write_never_serves_a_torn_block(directory: Path, layout: PoolLayout) -> None:
    """A child writes batches into a DiskPool in a loop (creating slabs, deleting the oldest
    blocks to make room, alternating durability) and is SIGKILLed at random moments; after each
    kill this process re-attaches and every block it is served has its key's bytes."""
    rng = np.random.default_rng()
    checked = torn = 0
    for round_ in range(KILLS):
        child = _start_writer(directory, ["commit", "none"][round_ % 2])
        try:
            try:
                child.wait(timeout=float(rng.uniform(0.1, 0.6)))
                pytest.fail(f"the writer exited by itself ({child.returncode})")
            except subprocess.TimeoutExpired:
                pass
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(timeout=30) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
            assert child.stdout is not None
            child.stdout.close()
        with open_pool(directory) as disk:
            assert disk.attached
            keys = disk.keys()
            try:
                load_and_check(disk, keys)
            except BlocksMissingError as exc:  # pragma: no cover - the failure itself
                pytest.fail(f"committed blocks failed verification after a kill: {exc}")
            assert disk.stats.checksum_failures == 0
            checked += len(keys)
            torn += disk.stats.torn_discarded
    assert checked > 0  # the survivor really had blocks to serve
    print(f"checked {checked} blocks after {KILLS} kills; {torn} torn writes dropped")


def test_slab_runs_group_consecutive_slots_of_one_file() -> None:
    """Every job lands in exactly one run; a run's slots follow each other in one slab file
    (so one preadv/pwritev covers them), within the size cap; random slot orders included."""
    rng = np.random.default_rng(11)
    slot_bytes = 128 << 10
    cap = disk_pool_module.MAX_RUN_BYTES // slot_bytes
    for _ in range(200):
        n = int(rng.integers(0, 80))
        slots = rng.permutation(200)[:n] if rng.random() < 0.5 else np.arange(n) + 3
        jobs = [
            (10 + int(s) // 50, i, 4096 + (int(s) % 50) * slot_bytes) for i, s in enumerate(slots)
        ]
        runs = disk_pool_module._slab_runs(jobs, slot_bytes)
        assert sorted(i for run in runs for i in run) == list(range(n))
        for run in runs:
            assert len(run) <= cap
            fds = {jobs[i][0] for i in run}
            offsets = [jobs[i][2] for i in run]
            assert len(fds) == 1
            assert offsets == [offsets[0] + k * slot_bytes for k in range(len(run))]
        if n and np.array_equal(slots, np.arange(n) + 3):  # one file's worth: few, long runs
            assert len(runs) <= -(-n // cap) + 2
