"""SharedFsPool, the shared-filesystem tier: blocks round-trip bit for bit through DRAM, files
and a fresh DRAM pool; other processes (standing in for other hosts) read what one wrote; writers
of the same key — threads and processes — never disturb readers, who never see a partial file;
a writer SIGKILLed mid-write leaves only whole blocks and ignorable temporary files; damaged,
truncated, foreign and misplaced files are counted misses; bad input is a clear error.

The cross-process tests run tests/helpers/shared_fs_child.py: the children fill DRAM pools through
the slot interface with bytes that are a function of the key (``expected``, defined there), so any
process can check any block it is served.
"""

from __future__ import annotations

import errno
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from paths import HELPERS
from shared_fs_child import (
    big_layout,
    check_served,
    expected,
    fill,
    key_for,
    payload_of,
    small_layout,
)

from tpusync import DevicePool
from tpusync._src.tiers.shared_fs import file_format as sfs
from tpusync.errors import (
    BlocksMissingError,
    InvalidArgumentError,
    TierFullError,
    TpuSyncError,
    TransferFailedError,
)
from tpusync.tiers import HostPool, LowerTier, PoolLayout, SharedFsPool

TIMEOUT = 60.0
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
HEADER = sfs.HEADER_BYTES


def temp_files(directory: str | Path) -> list[Path]:
    return [p for p in Path(directory).rglob(".*") if sfs.TEMP_MARK in p.name]


def block_files(directory: str | Path) -> list[Path]:
    return sorted(Path(directory).rglob(f"*{sfs.SUFFIX}"))


@pytest.fixture
def open_tier(tmp_path: Path):
    """Makes SharedFsPools (default: on tmp_path/shared) and closes them after the test."""
    made: list[SharedFsPool] = []
    shared = tmp_path / "shared"
    shared.mkdir()

    def make(layout: PoolLayout, directory: Any = None, **kwargs: Any) -> SharedFsPool:
        tier = SharedFsPool(layout, shared if directory is None else directory, **kwargs)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


@pytest.fixture
def dram():
    """Makes anonymous HostPools and closes them after the test."""
    made: list[HostPool] = []

    def make(layout: PoolLayout, capacity: int) -> HostPool:
        pool = HostPool(layout, capacity, populate=False)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.close()


# --- the round trip, bit for bit --------------------------------------------------------------

NB = 8


def _device_model(arrays, rng, mesh, kind: str) -> tuple[list[DevicePool], list[np.ndarray]]:
    if kind == "per-layer":  # mixed dtypes, K and V apart
        shapes = [((NB, 4, 16), BF16), ((NB, 4, 16), BF16), ((NB, 8, 8), E4M3), ((NB, 2, 8), "f4")]
        host = [arrays.random(rng, s, d) for s, d in shapes]
        pools = [DevicePool(jax.device_put(x.copy(), jax.devices()[0])) for x in host]
    else:  # sharded over 4 devices (2 replicas), block axis 1: several pieces per array
        sharding = NamedSharding(mesh, P(None, None, "a"))
        host = [arrays.random(rng, (2, NB, 8, 16), BF16) for _ in range(2)]
        pools = [DevicePool(jax.device_put(x.copy(), sharding)) for x in host]
    return pools, host


@pytest.mark.parametrize(("kind", "durability"), [("per-layer", "commit"), ("sharded", "none")])
def test_round_trip_exact_bits(arrays, rng, mesh, path, open_tier, dram, kind, durability):
    """device -> DRAM -> shared FS -> a new DRAM pool -> device, bit for bit (NaN payloads too)."""
    pools, host = _device_model(arrays, rng, mesh, kind)
    axis = 0 if kind == "per-layer" else 1
    layout = PoolLayout.from_pools(f"model-{kind}", pools, block_axis=axis)
    keys = [key_for(i) for i in range(NB)]
    source = dram(layout, NB)
    assert source.put_from_device(keys, pools, range(NB), path=path) == NB

    tier = open_tier(layout, durability=durability)
    assert isinstance(tier, LowerTier)
    assert tier.put(keys, source) == NB
    assert tier.put(keys, source) == 0  # already stored: skipped
    assert tier.keys() == sorted(keys)
    assert tier.used == NB
    assert tier.contains([*keys[:2], b"absent"]) == [True, True, False]
    for key in keys:
        file = Path(tier.path_of(key))
        assert file.parent.parent.name == layout.fingerprint.hex()
        assert file.parent.name == key[:1].hex()
        assert file.stat().st_size == HEADER + layout.payload_bytes
    assert not temp_files(tier.directory)

    target = dram(layout, NB)
    tier.get(keys, target)
    for key in keys:
        assert payload_of(target, key) == payload_of(source, key)

    # Back to device: zeroed pools, blocks in reverse order.
    zeros = [
        DevicePool(jax.device_put(np.zeros_like(x), p.array.sharding))
        for x, p in zip(host, pools, strict=True)
    ]
    order = list(reversed(range(NB)))
    target.get_to_device(keys, zeros, order, path=path)
    for a, (pool, original) in enumerate(zip(zeros, host, strict=True)):
        got = np.asarray(pool.array)
        for i, b in enumerate(order):
            arrays.assert_same(np.take(got, b, axis=axis), np.take(original, i, axis=axis), f"{a}")

    stats = tier.stats.as_dict()
    assert stats["puts"] == NB and stats["hits"] == NB and stats["misses"] == 0
    assert stats["bytes_in"] == stats["bytes_out"] == NB * layout.payload_bytes


def test_get_reports_absent_keys_and_commits_the_rest(open_tier, dram):
    layout = small_layout()
    keys = [key_for(i) for i in range(4)]
    source = dram(layout, 4)
    fill(source, keys)
    tier = open_tier(layout)
    assert tier.put(keys[:3], source) == 3

    target = dram(layout, 8)
    fill(target, [key_for(100)])  # already in the target: loaded without a read
    request = [keys[0], b"nope", keys[3], keys[1], keys[0], key_for(100)]
    with pytest.raises(BlocksMissingError) as info:
        tier.get(request, target)
    assert info.value.loaded == [True, False, False, True, True, True]
    assert info.value.corrupt == 0
    assert "2 absent" in str(info.value)
    check_served(target, [keys[0], keys[1], key_for(100)])
    assert target.contains([b"nope", keys[3]]) == [False, False]
    assert target.free == 8 - 3  # the aborted slots came back
    assert tier.stats.hits == 2 and tier.stats.misses == 2

    tier.get([], target)  # nothing asked, nothing done
    assert tier.delete([keys[0], keys[0], b"nope"]) == 1
    assert tier.keys() == sorted(keys[1:3])
    assert tier.stats.deletes == 1


def test_several_pools_on_one_directory_keep_layouts_apart(tmp_path, open_tier, dram):
    ours, theirs = small_layout("ours"), small_layout("theirs")
    key = key_for(1)
    source = dram(theirs, 1)
    fill(source, [key])
    open_tier(theirs).put([key], source)
    tier = open_tier(ours)
    assert tier.keys() == [] and tier.contains([key]) == [False]
    with pytest.raises(BlocksMissingError):
        tier.get([key], dram(ours, 1))
    assert {p.name for p in (tmp_path / "shared").iterdir()} == {
        ours.fingerprint.hex(),
        theirs.fingerprint.hex(),
    }


# --- damaged, truncated, foreign and misplaced files --------------------------------------------


def _rewrite(file: Path, data: bytes) -> None:
    file.write_bytes(data)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1 :]


def _with_version(data: bytes, version: int) -> bytes:
    fixed = bytearray(data[: sfs._FIXED.size])
    struct.pack_into("<I", fixed, 8, version)
    check = sfs._CHECK.pack(sfs._core.xxh64(bytes(fixed)))
    return bytes(fixed) + check + data[sfs.HEADER_USED :]


DAMAGE = {
    # name: (how the file of key 0 is damaged, corrupt count, file removed)
    "payload-byte": (lambda f, d, ctx: _rewrite(f, _flip(d, HEADER + len(d) // 3)), 1, True),
    "last-byte": (lambda f, d, ctx: _rewrite(f, _flip(d, len(d) - 1)), 1, True),
    "truncated-payload": (lambda f, d, ctx: _rewrite(f, d[: HEADER + 5000]), 1, True),
    "truncated-header": (lambda f, d, ctx: _rewrite(f, d[:100]), 1, True),
    "empty": (lambda f, d, ctx: _rewrite(f, b""), 1, True),
    "extra-bytes": (lambda f, d, ctx: _rewrite(f, d + b"\0" * 10), 1, True),
    "garbage-header": (lambda f, d, ctx: _rewrite(f, ctx["rng"].bytes(HEADER) + d[HEADER:]), 1, 1),
    "header-field": (lambda f, d, ctx: _rewrite(f, _flip(d, 40)), 1, True),  # inside the key
    "header-padding": (lambda f, d, ctx: _rewrite(f, _flip(d, 3000)), 0, False),  # not data
    "another-key": (lambda f, d, ctx: _rewrite(f, ctx["other"].read_bytes()), 1, True),
    "wrong-fingerprint": (lambda f, d, ctx: _rewrite(f, ctx["foreign"]), 1, True),
    "future-version": (lambda f, d, ctx: _rewrite(f, _with_version(d, 2)), 0, False),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_a_counted_miss(tmp_path, rng, open_tier, dram, damage):
    layout = small_layout()
    keys = [key_for(i) for i in range(3)]
    source = dram(layout, 3)
    fill(source, keys)
    tier = open_tier(layout)
    tier.put(keys, source)
    # A block of another layout (same payload size, another fingerprint) under the same key.
    foreign_dir = tmp_path / "foreign"
    foreign_dir.mkdir()
    other_layout = small_layout("another-model")
    other_source = dram(other_layout, 1)
    fill(other_source, keys[:1])
    with SharedFsPool(other_layout, foreign_dir) as other_tier:
        other_tier.put(keys[:1], other_source)
        foreign = Path(other_tier.path_of(keys[0])).read_bytes()

    file = Path(tier.path_of(keys[0]))
    how, corrupt, removed = DAMAGE[damage]
    ctx = {"rng": rng, "other": Path(tier.path_of(keys[1])), "foreign": foreign}
    how(file, file.read_bytes(), ctx)

    target = dram(layout, 3)
    if damage == "header-padding":  # the padding is not covered: still a whole, valid block
        tier.get(keys, target)
        check_served(target, keys)
        return
    with pytest.raises(BlocksMissingError) as info:
        tier.get(keys, target)
    assert info.value.loaded == [False, True, True]
    assert info.value.corrupt == corrupt
    assert tier.stats.checksum_failures == corrupt
    assert tier.stats.misses == 1 and tier.stats.hits == 2
    check_served(target, keys[1:], damage)
    assert target.contains(keys[:1]) == [False]
    assert target.free == 1
    assert file.exists() != removed
    if removed:  # the name is free again: a new put repairs it
        assert tier.contains(keys[:1]) == [False]
        assert tier.put(keys, source) == 1
        tier.get(keys[:1], target)
        check_served(target, keys)


def test_corrupt_file_republished_meanwhile_is_not_removed(open_tier, dram, monkeypatch):
    """A reader that found a file corrupt removes it only if the name still refers to that file:
    a writer may have republished the key since."""
    layout = small_layout()
    key = key_for(7)
    source = dram(layout, 1)
    fill(source, [key])
    tier, writer = open_tier(layout), open_tier(layout)
    tier.put([key], source)
    file = Path(tier.path_of(key))
    file.write_bytes(_flip(file.read_bytes(), HEADER + 10))

    real = SharedFsPool._read_block

    def read_then_republish(self: SharedFsPool, job: Any) -> Any:
        outcome = real(self, job)
        writer.put([key], source, overwrite=True)  # after the read, before the verdict
        return outcome

    monkeypatch.setattr(SharedFsPool, "_read_block", read_then_republish)
    with pytest.raises(BlocksMissingError) as info:
        tier.get([key], dram(layout, 1))
    assert info.value.corrupt == 1
    monkeypatch.undo()
    target = dram(layout, 1)
    tier.get([key], target)  # the republished file survived the reader's clean-up
    check_served(target, [key])


def test_corrupt_dram_block_is_not_published(open_tier, dram):
    layout = small_layout()
    keys = [key_for(i) for i in range(3)]
    source = dram(layout, 3)
    fill(source, keys)
    source.slot_memory(source.slot_of(keys[1]))[100] ^= 0xFF
    tier = open_tier(layout)
    with pytest.raises(BlocksMissingError) as info:
        tier.put(keys, source)
    assert info.value.loaded == [True, False, True] and info.value.corrupt == 1
    assert block_files(tier.directory) == []  # nothing written
    assert source.contains(keys) == [True, False, True]  # dropped from DRAM
    assert source.stats.checksum_failures == 1
    assert tier.put([keys[0], keys[2]], source) == 2


@pytest.mark.parametrize("failing", ["hash_slots", "commit"])
def test_a_failure_inside_get_returns_every_slot_once(open_tier, dram, monkeypatch, failing):
    """An exception after the slots were reserved (hashing, committing) leaves the DRAM pool as
    it was: every reserved slot is free again, none twice."""
    layout = small_layout()
    keys = [key_for(i) for i in range(4)]
    source = dram(layout, 4)
    fill(source, keys)
    tier = open_tier(layout)
    tier.put(keys[:3], source)
    target = dram(layout, 4)

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected")

    monkeypatch.setattr(target, failing, boom)
    with pytest.raises(RuntimeError, match="injected"):
        tier.get(keys, target)
    monkeypatch.undo()
    assert target.free == 4 and target.used == 0
    reservation = target.reserve([key_for(i) for i in range(10, 14)])
    assert sorted(reservation.slots.tolist()) == [0, 1, 2, 3]  # each slot free exactly once
    target.abort(reservation)
    with pytest.raises(BlocksMissingError) as info:
        tier.get(keys, target)
    assert info.value.loaded == [True, True, True, False]
    check_served(target, keys[:3])


@pytest.mark.parametrize("io_threads", [1, 3, 8])
def test_io_threads_run_every_item_once_in_order(open_tier, io_threads):
    """Each I/O thread takes the next item until none is left: every call runs once, results
    come back in item order, failures in place (captured) or the first by order (raised)."""
    tier = open_tier(small_layout(), io_threads=io_threads)
    calls: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> int:
        with lock:
            calls.append(i)
        if i % 7 == 3:
            raise ValueError(f"item {i}")
        return i * i

    items = list(range(100))
    out = tier._run_all(work, items, capture=True)
    assert sorted(calls) == items
    for i, result in enumerate(out):
        if i % 7 == 3:
            assert isinstance(result, ValueError) and str(result) == f"item {i}"
        else:
            assert result == i * i
    calls.clear()
    with pytest.raises(ValueError, match=r"^item 3$"):
        tier._run_all(work, items)
    assert sorted(calls) == items  # the others still ran: none is left running on return


def test_existence_checks_use_threads_only_when_stat_is_slow(open_tier, dram, monkeypatch):
    """A local filesystem answers stat in microseconds: the keys are checked in the caller's
    thread. Where the first answers are slow (a shared filesystem's round trips; slowed here,
    since this machine has none), the rest go to the I/O threads. Both answer the same."""
    layout = small_layout()
    keys = [key_for(i) for i in range(40)]
    source = dram(layout, 20)
    fill(source, keys[:20])
    tier = open_tier(layout, io_threads=4)
    tier.put(keys[:20], source)
    threads: set[str] = set()
    original = tier._exists

    def recording(key: bytes) -> bool:
        threads.add(threading.current_thread().name)
        return original(key)

    monkeypatch.setattr(tier, "_exists", recording)
    truth = [True] * 20 + [False] * 20
    assert tier.contains(keys) == truth
    assert threads == {threading.current_thread().name}

    def slow(key: bytes) -> bool:
        time.sleep(sfs._FAST_STAT_S * 4)
        return recording(key)

    threads.clear()
    monkeypatch.setattr(tier, "_exists", slow)
    assert tier.contains(keys) == truth
    assert any(name.startswith("tpusync-sharedfs") for name in threads)


# --- temporary files, sweep, durability, I/O errors ---------------------------------------------


def test_stale_temp_files_are_invisible_and_swept(open_tier, dram):
    layout = small_layout()
    keys = [key_for(i) for i in range(4)]
    source = dram(layout, 4)
    fill(source, keys)
    tier = open_tier(layout)
    tier.put(keys[:2], source)
    # What crashed writers leave: a whole temp file of a published key, a partial one and an
    # empty one of unpublished keys, and one of the layout description.
    whole = Path(tier.path_of(keys[0])).read_bytes()
    leftovers = []
    for key, data in [(keys[0], whole), (keys[2], whole[: HEADER + 99]), (keys[3], b"")]:
        folder = Path(tier.path_of(key)).parent
        folder.mkdir(exist_ok=True)
        temp = folder / f".{key.hex()}{sfs.TEMP_MARK}deadhost-4242-0123456789abcdef"
        temp.write_bytes(data)
        leftovers.append(temp)
    root = Path(tier.path_of(keys[0])).parent.parent
    leftovers.append(root / f".layout.json{sfs.TEMP_MARK}deadhost-4242-00")
    leftovers[-1].write_text("{")

    assert tier.keys() == sorted(keys[:2])
    assert tier.contains(keys) == [True, True, False, False]
    target = dram(layout, 4)
    with pytest.raises(BlocksMissingError) as info:
        tier.get(keys, target)
    assert info.value.loaded == [True, True, False, False] and info.value.corrupt == 0

    assert tier.sweep(older_than_s=3600) == 0  # young: may belong to a live writer
    old = time.time() - 7200
    for temp in leftovers[:3]:
        os.utime(temp, (old, old))
    assert tier.sweep(older_than_s=3600) == 3
    assert temp_files(tier.directory) == [leftovers[3]]
    assert tier.sweep(older_than_s=0) == 1
    assert temp_files(tier.directory) == []
    assert tier.keys() == sorted(keys[:2])  # published blocks untouched

    with pytest.raises(InvalidArgumentError, match="older_than_s"):
        tier.sweep(older_than_s=-1)


def test_sweep_all_layouts(open_tier, dram):
    a, b = open_tier(small_layout("a")), open_tier(small_layout("b"))
    for tier in (a, b):
        folder = Path(tier.path_of(key_for(1))).parent
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f".x{sfs.TEMP_MARK}h-1-2").write_bytes(b"partial")
    assert a.sweep(0) == 1
    assert len(temp_files(b.directory)) == 1
    assert a.sweep(0, all_layouts=True) == 1
    assert temp_files(b.directory) == []


@pytest.mark.parametrize("durability", ["commit", "none"])
def test_durability_modes(open_tier, dram, monkeypatch, durability):
    layout = small_layout()
    keys = [key_for(i) for i in range(6)]
    source = dram(layout, 6)
    fill(source, keys)
    tier = open_tier(layout, durability=durability, io_threads=1)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert tier.put(keys, source) == 6
    files = {tier.path_of(k) for k in keys}
    folders = {os.path.dirname(f) for f in files}
    if durability == "commit":
        # Every file before its rename (under its temporary name), every block directory after
        # the renames, and the layout directory after each new block directory.
        assert sum(sfs.TEMP_MARK in s for s in synced) == len(keys)
        assert folders <= set(synced)
        assert os.path.dirname(next(iter(folders))) in synced
    else:
        assert synced == []
    synced.clear()
    tier.delete(keys[:1])
    assert (synced != []) == (durability == "commit")
    target = dram(layout, 6)
    tier.get(keys[1:], target)
    check_served(target, keys[1:])


@pytest.mark.parametrize(
    ("code", "error"), [(errno.ENOSPC, TierFullError), (errno.EIO, TransferFailedError)]
)
def test_write_errors_leave_nothing_behind(open_tier, dram, monkeypatch, code, error):
    layout = small_layout()
    keys = [key_for(i) for i in range(3)]
    source = dram(layout, 3)
    fill(source, keys)
    tier = open_tier(layout)
    tier.put(keys[:1], source)
    real = os.pwritev
    calls = []

    def failing(fd: int, buffers: Any, offset: int) -> int:
        calls.append(fd)
        if len(calls) == 2:  # the second block of the batch fails
            raise OSError(code, os.strerror(code))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", failing)
    with pytest.raises(error) as info:
        tier.put(keys, source)
    assert "whole" in str(info.value)
    monkeypatch.undo()
    assert temp_files(tier.directory) == []
    assert len(tier.keys()) == 2  # the key stored before, and the batch's block that made it
    assert source.contains(keys) == [True] * 3
    target = dram(layout, 3)
    tier.put(keys, source)
    tier.get(keys, target)
    check_served(target, keys)


def test_failed_rename_removes_the_temp_file(open_tier, dram, monkeypatch):
    layout = small_layout()
    source = dram(layout, 1)
    fill(source, [key_for(1)])
    tier = open_tier(layout)

    def rename(src: str, dst: str) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(TransferFailedError, match="writable"):
        tier.put([key_for(1)], source)
    assert temp_files(tier.directory) == [] and block_files(tier.directory) == []


def test_capacity_is_checked_before_writing(open_tier, dram):
    layout = small_layout()
    keys = [key_for(i) for i in range(5)]
    source = dram(layout, 5)
    fill(source, keys)
    tier = open_tier(layout, capacity=3)
    assert tier.capacity == 3
    with pytest.raises(TierFullError, match="capacity"):
        tier.put(keys[:4], source)
    assert tier.used == 0
    assert tier.put(keys[:2], source) == 2
    assert tier.put(keys[:3], source) == 1  # present keys do not count twice
    with pytest.raises(TierFullError):
        tier.put(keys[3:], source)
    assert tier.used == 3
    assert open_tier(layout).capacity == sys.maxsize  # unbounded


def test_target_full_reads_nothing(open_tier, dram):
    layout = small_layout()
    keys = [key_for(i) for i in range(3)]
    source = dram(layout, 3)
    fill(source, keys)
    tier = open_tier(layout)
    tier.put(keys, source)
    target = dram(layout, 2)
    with pytest.raises(TierFullError):
        tier.get(keys, target)
    assert target.free == 2 and tier.stats.hits == 0


# --- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"layout": "not a layout"}, "layout"),
        ({"directory": None}, "directory"),
        ({"directory": "missing"}, "directory"),
        ({"directory": "a-file"}, "directory"),
        ({"capacity": 0}, "capacity"),
        ({"capacity": True}, "capacity"),
        ({"capacity": 2.5}, "capacity"),
        ({"durability": "fsync"}, "durability"),
        ({"io_threads": 0}, "io_threads"),
    ],
)
def test_bad_constructor_arguments(tmp_path, kwargs, argument):
    (tmp_path / "a-file").write_bytes(b"")
    args = {"layout": small_layout(), "directory": tmp_path, **kwargs}
    if isinstance(args["directory"], str):
        args["directory"] = tmp_path / args["directory"]
    with pytest.raises(InvalidArgumentError) as info:
        SharedFsPool(args.pop("layout"), args.pop("directory"), **args)
    assert str(info.value).startswith(f"{argument}:")
    if argument == "directory" and kwargs["directory"] == "missing":
        assert "does not exist" in str(info.value) and not (tmp_path / "missing").exists()


BAD_KEYS = [["text"], [b""], [b"x" * 33], [5], [b"ok", None]]


@pytest.mark.parametrize("keys", BAD_KEYS, ids=["str", "empty", "too-long", "int", "none"])
def test_bad_keys_change_nothing(open_tier, dram, keys):
    layout = small_layout()
    source = dram(layout, 2)
    fill(source, [b"ok"])
    tier = open_tier(layout)
    target = dram(layout, 2)
    for call in (
        lambda: tier.put(keys, source),
        lambda: tier.get(keys, target),
        lambda: tier.contains(keys),
        lambda: tier.delete(keys),
        lambda: tier.path_of(keys[-1]),
    ):
        with pytest.raises(InvalidArgumentError, match=r"keys\[\d\]"):
            call()
    assert block_files(tier.directory) == [] and target.used == 0 and target.free == 2


def test_pools_of_another_layout_are_refused(open_tier, dram):
    layout = small_layout()
    tier = open_tier(layout)
    other = dram(small_layout("other"), 2)
    fill(other, [b"a"])
    with pytest.raises(InvalidArgumentError, match=r"source: .*another layout"):
        tier.put([b"a"], other)
    with pytest.raises(InvalidArgumentError, match=r"target: .*another layout"):
        tier.get([b"a"], other)
    with pytest.raises(InvalidArgumentError, match="target: expected a HostPool"):
        tier.get([b"a"], np.zeros(10))  # type: ignore[arg-type]
    assert block_files(tier.directory) == [] and other.used == 1


def test_absent_source_keys_write_nothing(open_tier, dram):
    layout = small_layout()
    source = dram(layout, 2)
    fill(source, [b"a"])
    tier = open_tier(layout)
    with pytest.raises(BlocksMissingError, match="not in the source pool") as info:
        tier.put([b"a", b"b", b"a"], source)
    assert info.value.loaded == [True, False, True]
    assert block_files(tier.directory) == []
    assert tier.put([b"a", b"a"], source) == 1  # duplicates are written once


def test_closed_pool_is_a_clear_error(open_tier, dram):
    layout = small_layout()
    source = dram(layout, 1)
    fill(source, [b"a"])
    with open_tier(layout) as tier:
        tier.put([b"a"], source)
    tier.close()  # twice is fine
    for call in (
        lambda: tier.put([b"a"], source),
        lambda: tier.get([b"a"], source),
        lambda: tier.contains([b"a"]),
        lambda: tier.keys(),
    ):
        with pytest.raises(TpuSyncError, match="closed"):
            call()


# --- the format, pinned -----------------------------------------------------------------------

# The 168 used bytes of the header of a version-1 block file for key 00..0f, fingerprint f0..ff,
# a payload of 4096 bytes with checksum 0x0123456789abcdef, written at 1e18 ns by "golden:1"
# (the last 8 bytes are the header checksum, XXH64 of the 160 before them).
GOLDEN_HEADER = bytes.fromhex(
    "54505553594e434201000000001000001000010000000000000102030405060708090a0b0c0d0e0f00000000"
    "000000000000000000000000f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff0010000000000000efcdab8967452301"
    "000064a7b3b6e00d676f6c64656e3a3100000000000000000000000000000000000000000000000000000000"
    "0000000000000000000000000000000000000000000000000000000043413722d40b0eaa"
)


def test_golden_header():
    """The header of format version 1, byte for byte, both ways: a change of the format without
    a version bump fails here."""
    fields = dict(
        key=bytes(range(16)),
        fingerprint=bytes(range(0xF0, 0x100)),
        payload_bytes=4096,
        checksum=0x0123456789ABCDEF,
        written_ns=10**18,
        writer="golden:1",
    )
    header = sfs.encode_block_header(**fields)
    assert len(header) == HEADER == 4096
    assert header == GOLDEN_HEADER.ljust(HEADER, b"\0")
    assert sfs.decode_block_header(GOLDEN_HEADER.ljust(HEADER, b"\0")) == sfs.BlockHeader(**fields)


# --- threads: writers of the same keys, readers beside them ----------------------------------


def test_threads_writing_the_same_keys(open_tier, dram):
    """Eight threads, each with its own SharedFsPool, put the same fresh keys at once (no
    overwrite: they race on the existence check and several write each key), then overwrite
    them again and again while two readers load them: every read is whole and valid."""
    layout = small_layout()
    keys = [key_for(i) for i in range(12)]
    source = dram(layout, len(keys))
    fill(source, keys)
    writers = [open_tier(layout, io_threads=2) for _ in range(8)]
    start = threading.Barrier(len(writers))
    counts: list[int] = []
    errors: list[BaseException] = []

    def first_put(tier: SharedFsPool) -> None:
        try:
            start.wait(TIMEOUT)
            counts.append(tier.put(keys, source))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=first_put, args=(t,)) for t in writers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert sum(counts) >= len(keys)
    print(f"{sum(counts)} writes of {len(keys)} keys by {len(writers)} racing threads")

    stop = threading.Event()

    def overwrite(tier: SharedFsPool) -> None:
        try:
            while not stop.is_set():
                tier.put(keys, source, overwrite=True)
        except BaseException as exc:
            errors.append(exc)

    def read(tier: SharedFsPool, rounds: list[int]) -> None:
        target = HostPool(layout, len(keys), populate=False)
        try:
            while not stop.is_set():
                tier.get(keys, target)  # no miss: a rename replaces the name atomically
                check_served(target, keys, "reader")
                assert target.delete(keys) == len(keys)
                rounds.append(1)
        except BaseException as exc:
            errors.append(exc)
        finally:
            target.close()

    rounds: list[int] = []
    threads = [threading.Thread(target=overwrite, args=(t,)) for t in writers[:4]]
    threads += [threading.Thread(target=read, args=(open_tier(layout), rounds)) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert len(rounds) > 2
    assert temp_files(writers[0].directory) == []


# --- processes: other hosts, concurrent writers, SIGKILL ---------------------------------------


def start_worker(*args: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(HELPERS / "shared_fs_child.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def read_line(child: subprocess.Popen[str], timeout: float = TIMEOUT) -> str:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"no word from the child within {timeout} s"
    line = child.stdout.readline()
    if not line:
        child.wait(TIMEOUT)
        assert child.stderr is not None
        pytest.fail(f"the child died (rc {child.returncode}): {child.stderr.read()}")
    return line.strip()


def finish(child: subprocess.Popen[str]) -> str:
    """Waits for a child that was asked to stop; returns its remaining output."""
    try:
        out, err = child.communicate(timeout=TIMEOUT)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=TIMEOUT)
    assert child.returncode == 0, f"rc {child.returncode}: {err}"
    return out


def test_another_process_reads_what_this_one_wrote(tmp_path, open_tier, dram):
    """The cross-host case: a process (another host) reads blocks this one wrote, and writes
    blocks this one then reads."""
    layout = big_layout()
    ours = [key_for(i) for i in range(6)]
    source = dram(layout, len(ours))
    fill(source, ours)
    tier = open_tier(layout)
    tier.put(ours, source)
    child = start_worker("read-write", tmp_path / "shared", 0, 6, 100, 104)
    assert read_line(child) == "ok"
    finish(child)
    theirs = [key_for(i) for i in range(100, 104)]
    assert tier.keys() == sorted(ours + theirs)
    target = dram(layout, len(theirs))
    tier.get(theirs, target)
    check_served(target, theirs, "written by the other process")


def test_readers_never_see_a_partial_file(tmp_path, open_tier, dram):
    """Two processes and two threads rewrite the same keys in a loop; meanwhile this process
    loads them over and over, and also reads the files raw: every block served verifies, no
    read misses, and no file under a published name is ever short."""
    layout = big_layout()
    keys = [key_for(i) for i in range(8)]
    stop_file = tmp_path / "stop"
    children = [
        start_worker("rewrite", tmp_path / "shared", stop_file, durability)
        for durability in ("commit", "none")
    ]
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        for child in children:
            assert read_line(child) == "ready"
        source = dram(layout, len(keys))
        fill(source, keys)

        def overwrite() -> None:
            try:
                with SharedFsPool(layout, tmp_path / "shared", durability="none") as tier:
                    while not stop.is_set():
                        tier.put(keys, source, overwrite=True)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=overwrite) for _ in range(2)]
        for t in threads:
            t.start()
        reader = open_tier(layout)
        target = dram(layout, len(keys))
        want = HEADER + layout.payload_bytes
        rounds = raw = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            tier_keys = reader.keys()
            assert tier_keys == sorted(keys)
            reader.get(keys, target)  # raises on any miss or checksum failure
            check_served(target, keys, f"round {rounds}")
            target.delete(keys)
            rounds += 1
            for key in keys[:2]:
                data = Path(reader.path_of(key)).read_bytes()
                assert len(data) == want, f"a published file of {len(data)} bytes"
                assert data[HEADER:] == expected(key, layout.payload_bytes)
                raw += 1
    finally:
        stop_file.touch()
        stop.set()
        outputs = [finish(child) for child in children]
    for t in threads:
        t.join(TIMEOUT)
    assert not errors, errors
    assert reader.stats.checksum_failures == 0 and reader.stats.misses == 0
    child_rounds = [int(out.split()[-1]) for out in outputs]
    print(f"{rounds} verified loads, {raw} raw reads; child rewrite rounds {child_rounds}")
    assert rounds > 2 and all(n > 1 for n in child_rounds)
    assert temp_files(tmp_path / "shared") == []


KILLS = 3


def test_sigkill_mid_write_leaves_only_whole_blocks(tmp_path, dram):
    """A child writes, overwrites and deletes blocks in a loop (durability "commit") and is
    SIGKILLed at a random moment, several times; after each kill, every block listed loads and
    matches its key's bytes, and the temporary files it left are invisible until swept."""
    layout = big_layout()
    shared = tmp_path / "shared"
    shared.mkdir()
    rng = np.random.default_rng()
    seen = temps = 0
    for round_ in range(KILLS):
        child = start_worker("churn", shared)
        try:
            assert read_line(child) == "ready"
            time.sleep(float(rng.uniform(0.1, 0.6)))
            os.kill(child.pid, signal.SIGKILL)
            assert child.wait(TIMEOUT) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                child.kill()
            child.communicate(timeout=TIMEOUT)
        with SharedFsPool(layout, shared) as tier:
            keys = tier.keys()
            assert keys, "the child wrote nothing before it was killed"
            target = dram(layout, len(keys))
            tier.get(keys, target)  # a torn or missing listed block raises here
            check_served(target, keys, f"after kill {round_}")
            left = temp_files(shared)
            temps += len(left)
            assert tier.contains([key_for(10**6)]) == [False]
            assert tier.sweep(older_than_s=0) == len(left)
            assert tier.keys() == keys
            seen += len(keys)
    print(f"{seen} blocks verified after {KILLS} kills; {temps} temporary files swept")
