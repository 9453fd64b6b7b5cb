"""HostPool, the DRAM tier: device blocks in and out bit for bit on both engines, named pools in
/dev/shm that survive close and the death of their owner, one owner at a time, and never a wrong
byte: torn writes, foreign or damaged files and flipped bits are misses or clean errors.

Named pools get a fresh name per test, with this run's tag (``<tag>-kv-<hex>``,
tests/helpers/run_names.py); their files are removed when the test ends, whatever happened.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from device_model import (
    BF16,
    NB,
    Model,
    as_bits,
    at,
    keys_for,
    load,
    make_model,
    put,
    store,
)
from tools import skip_or_fail

from tpusync import DevicePool
from tpusync._src.tiers.dram import pool_path
from tpusync._src.tiers.dram.pool_file import WRITING
from tpusync.errors import (
    BlockIndexError,
    BlocksHeldError,
    BlocksMissingError,
    InvalidArgumentError,
    PoolBusyError,
    PoolFormatError,
    TierFullError,
    TpuSyncError,
)
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout, all_tier_stats

TIMEOUT = 60.0
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def slot_payload(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None, f"{key!r} is not in the pool"
    start = pool.geometry.data_offset + slot * pool.layout.slot_bytes
    with memoryview(pool._mapping) as memory:
        return bytes(memory[start : start + pool.layout.payload_bytes])


def verify_all(pool: HostPool, model: Model, path: str, first_block: int = 0) -> None:
    """Every key in the pool loads bit-exactly (into blocks first_block...)."""
    keys = pool.keys()
    assert len(keys) <= NB - first_block
    if keys:
        load(pool, model, keys, list(range(first_block, first_block + len(keys))), path)


# --- fixtures: fresh names, pools that are always closed -----------------------------------------


@pytest.fixture
def new_name(shm_names: Callable[[], str]) -> Callable[[], str]:
    """Unique pool names whose files are removed afterwards (conftest's ``shm_names``)."""
    return shm_names


@pytest.fixture
def open_pool(new_name) -> Iterator[Callable[..., HostPool]]:
    """HostPool(...), closed at the end of the test (before the files are removed)."""
    opened: list[HostPool] = []

    def open_(*args: Any, **kwargs: Any) -> HostPool:
        pool = HostPool(*args, **kwargs)
        opened.append(pool)
        return pool

    yield open_
    for pool in reversed(opened):
        pool.close()


# --- round trips -------------------------------------------------------------------------------

ROUND_TRIPS = [
    # kind, dtype, named
    ("per-layer", BF16, False),
    ("per-layer", E4M3, False),
    ("per-layer", E5M2, False),
    ("per-layer", np.dtype(np.int8), False),
    ("per-layer", np.dtype(np.float32), False),
    ("per-layer", BF16, True),
    ("stacked", BF16, False),
    ("stacked", E5M2, True),
    ("sharded", BF16, False),
    ("sharded", np.dtype(np.float32), True),
    ("stacked-sharded", E4M3, False),
]


@pytest.mark.parametrize(
    ("kind", "dtype", "named"),
    ROUND_TRIPS,
    ids=[f"{k}-{d}-{'named' if n else 'anon'}" for k, d, n in ROUND_TRIPS],
)
def test_round_trip(arrays, rng, mesh, path, open_pool, new_name, kind, dtype, named):
    model = make_model(arrays, rng, mesh, kind, dtype)
    pool = open_pool(model.layout, 6, name=new_name() if named else None)
    assert (pool.path is not None) == named
    assert not pool.attached
    assert (len(pool), pool.free, pool.used) == (0, 6, 0)
    src = [0, 2, 5]  # block 0 holds the NaN payloads of random_array
    keys = keys_for(src)
    assert store(pool, model, keys, src, path) == 3
    assert (len(pool), pool.free) == (3, 3)
    assert pool.keys() == keys
    assert pool.contains([*keys, b"other"]) == [True, True, True, False]
    for key in keys:
        # the slot holds the block in the documented format, with the documented checksum
        assert slot_payload(pool, key) == b"".join(model.pieces(key))
        assert int(pool._records["checksum"][pool.slot_of(key)]) == model.checksum(key)
    model.check("after storing (the sources are untouched)")

    dst = [7, 1, 3]  # other blocks; 3 gets block 5's data while block 5 stays
    load(pool, model, keys[::-1], dst, path)
    stats = pool.stats
    assert stats in all_tier_stats()
    assert (stats.puts, stats.hits, stats.misses, stats.checksum_failures) == (3, 3, 0, 0)
    assert stats.bytes_in == stats.bytes_out == 3 * model.layout.payload_bytes


def test_checksums_do_not_depend_on_the_engine(arrays, rng, mesh, open_pool, new_name):
    """A block stored by one engine has the same checksum as stored by the other, and a named
    pool written by one loads through the other after close and re-attach."""
    model = make_model(arrays, rng, mesh, "stacked-sharded", BF16)
    names = {"native": new_name(), "jax": new_name()}
    src = [1, 6, 0, 3]
    keys = keys_for(src)
    sums = {}
    for path, name in names.items():
        pool = open_pool(model.layout, 5, name=name)
        store(pool, model, keys, src, path)
        sums[path] = [int(pool._records["checksum"][pool.slot_of(k)]) for k in keys]
        pool.close()
    assert sums["native"] == sums["jax"] == [model.checksum(k) for k in keys]
    for stored_by, loaded_by in (("native", "jax"), ("jax", "native")):
        pool = open_pool(model.layout, 5, name=names[stored_by])
        assert pool.attached
        assert pool.keys() == keys
        load(pool, model, keys, [2, 4, 5, 7], loaded_by)
        assert pool.stats.checksum_failures == 0
        pool.close()


# --- named pools: re-attach, ownership ----------------------------------------------------------


def test_reattach_after_close(arrays, rng, mesh, path, open_pool, new_name):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    pool = open_pool(model.layout, 6, name=name)
    assert pool.path == Path("/dev/shm") / f"tpusync-{name}.pool"
    assert pool.path.stat().st_size == pool.geometry.file_bytes
    keys = keys_for([4, 1, 2])
    store(pool, model, keys, [4, 1, 2], path)
    assert pool.delete([keys[1]]) == 1
    pool.close()
    pool.close()  # twice is harmless
    assert pool.path.exists()

    again = open_pool(model.layout, 6, name=name)
    assert again.attached
    assert again.attach_seconds > 0
    assert again.keys() == [keys[0], keys[2]]
    assert (len(again), again.free) == (2, 4)
    assert again.stats.torn_discarded == 0
    load(again, model, again.keys(), [6, 7], path)
    # it keeps working: new blocks come after the old ones
    store(again, model, [b"new"], [3], path)
    assert again.keys() == [keys[0], keys[2], b"new"]
    again.close()
    third = open_pool(model.layout, 6, name=name)
    assert third.keys() == [keys[0], keys[2], b"new"]
    verify_all(third, model, path, first_block=5)


def test_a_second_open_is_busy(arrays, rng, mesh, open_pool, new_name):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    first = open_pool(model.layout, 4, name=name)
    store(first, model, [b"a"], [0], "native")
    for mismatch in ("recreate", "error"):
        with pytest.raises(PoolBusyError) as info:
            open_pool(model.layout, 4, name=name, on_mismatch=mismatch)
        assert isinstance(info.value, RuntimeError)
        assert "name" in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    # even a pool of another layout is refused, not recreated under its owner's feet
    other = PoolLayout("another-model", model.layout.arrays)
    with pytest.raises(PoolBusyError):
        open_pool(other, 4, name=name)
    assert first.keys() == [b"a"]
    load(first, model, [b"a"], [5], "native")
    first.close()
    second = open_pool(model.layout, 4, name=name)
    assert second.attached and second.keys() == [b"a"]


CHILD = """
import json, sys
from tpusync.tiers import HostPool, PoolLayout
layout = PoolLayout.from_description(json.loads(sys.argv[1]))
pool = HostPool(layout, int(sys.argv[2]), name=sys.argv[3])
print("attached" if pool.attached else "created", len(pool), flush=True)
sys.stdin.read()
"""


def read_line(child: subprocess.Popen[str], timeout: float) -> str:
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    assert ready, f"no word from the child within {timeout} s"
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(TIMEOUT)
        assert child.stderr is not None
        pytest.fail(f"the child died (rc {child.returncode}): {child.stderr.read()}")
    return line.strip()


def test_busy_while_a_child_process_owns_it_then_free_when_it_dies(
    arrays, rng, mesh, open_pool, new_name
):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    pool = open_pool(model.layout, 4, name=name)
    keys = keys_for([3, 5])
    store(pool, model, keys, [3, 5], "native")
    pool.close()

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-c", CHILD, json.dumps(model.layout.describe()), "4", name]
    with subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as child:
        try:
            assert read_line(child, TIMEOUT) == "attached 2"
            with pytest.raises(PoolBusyError) as info:
                open_pool(model.layout, 4, name=name)
            assert f"pid {child.pid}" in str(info.value)
            os.kill(child.pid, signal.SIGKILL)  # no clean-up of any kind: the kernel drops the lock
            assert child.wait(TIMEOUT) == -signal.SIGKILL
        finally:
            if child.poll() is None:
                os.kill(child.pid, signal.SIGKILL)
                child.wait(TIMEOUT)
    again = open_pool(model.layout, 4, name=name)
    assert again.attached
    assert again.keys() == keys
    load(again, model, keys, [0, 1], "jax")


# --- mismatched, damaged and foreign files ------------------------------------------------------


def file_state(target: Path) -> tuple[int, bytes]:
    data = target.read_bytes()
    return len(data), data


def test_mismatch_error_leaves_the_file(arrays, rng, mesh, path, open_pool, new_name):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    pool = open_pool(model.layout, 4, name=name)
    store(pool, model, [b"a", b"b"], [0, 1], path)
    pool.close()
    before = file_state(pool.path)
    others = {
        "another model": (PoolLayout("other", model.layout.arrays), 4),
        "another dtype": (
            PoolLayout(
                model.layout.model_id,
                tuple(
                    ArrayLayout(a.name, "float16", a.shard_block_shape, a.block_axis, a.n_shards)
                    for a in model.layout.arrays
                ),
            ),
            4,
        ),
        "another capacity": (model.layout, 5),
    }
    for what, (layout, capacity) in others.items():
        with pytest.raises(PoolFormatError) as info:
            open_pool(layout, capacity, name=name, on_mismatch="error")
        assert isinstance(info.value, ValueError)
        assert str(pool.path) in str(info.value), what
        assert file_state(pool.path) == before, f"{what}: the file changed"
    again = open_pool(model.layout, 4, name=name, on_mismatch="error")
    assert again.attached and again.keys() == [b"a", b"b"]
    verify_all(again, model, path, first_block=4)


def test_mismatch_recreate_starts_cold_and_says_so(
    arrays, rng, mesh, path, open_pool, new_name, caplog
):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    pool = open_pool(model.layout, 4, name=name)
    store(pool, model, [b"a", b"b"], [0, 1], path)
    pool.close()
    caplog.set_level(logging.INFO, logger="tpusync.tiers")
    bigger = open_pool(model.layout, 7, name=name, on_mismatch="recreate")
    assert not bigger.attached
    assert (len(bigger), bigger.free) == (0, 7)
    assert bigger.path.stat().st_size == bigger.geometry.file_bytes
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert str(bigger.path) in warnings[0].getMessage()
    assert "cold" in warnings[0].getMessage()
    store(bigger, model, [b"c"], [2], path)
    load(bigger, model, [b"c"], [3], path)
    bigger.close()
    # and the old layout now finds the new pool, not its own
    with pytest.raises(PoolFormatError):
        open_pool(model.layout, 4, name=name, on_mismatch="error")
    assert open_pool(model.layout, 7, name=name).keys() == [b"c"]


def _valid_pool_file(model: Model, name: str, capacity: int) -> Path:
    pool = HostPool(model.layout, capacity, name=name)
    pool.put_from_device([b"a"], model.pools, [0])
    pool.close()
    assert pool.path is not None
    return pool.path


DAMAGE: dict[str, Callable[[Path, np.random.Generator], None]] = {
    "garbage": lambda p, rng: p.write_bytes(rng.bytes(p.stat().st_size)),
    "empty": lambda p, rng: p.write_bytes(b""),
    "short header": lambda p, rng: p.write_bytes(p.read_bytes()[:40]),
    "header only": lambda p, rng: p.write_bytes(p.read_bytes()[:4096]),
    "truncated slots": lambda p, rng: os.truncate(p, p.stat().st_size - 4096),
    "another version": lambda p, rng: p.write_bytes(
        p.read_bytes()[:8] + (99).to_bytes(4, "little") + p.read_bytes()[12:]
    ),
    "damaged description": lambda p, rng: p.write_bytes(
        p.read_bytes().replace(b'"model_id"', b'"model_i\xff"', 1)
    ),
    "not a pool at all": lambda p, rng: p.write_text("hello\n" * 2000),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_error(arrays, rng, mesh, open_pool, new_name, damage):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    target = _valid_pool_file(model, name, 4)
    DAMAGE[damage](target, rng)
    before = file_state(target)
    with pytest.raises(PoolFormatError) as info:
        open_pool(model.layout, 4, name=name, on_mismatch="error")
    assert str(target) in str(info.value)
    assert file_state(target) == before


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_recreate(arrays, rng, mesh, open_pool, new_name, caplog, damage):
    model = make_model(arrays, rng, mesh)
    name = new_name()
    target = _valid_pool_file(model, name, 4)
    DAMAGE[damage](target, rng)
    pool = open_pool(model.layout, 4, name=name, on_mismatch="recreate")
    assert not pool.attached
    assert (len(pool), pool.free) == (0, 4)
    assert target.stat().st_size == pool.geometry.file_bytes
    assert any(
        r.levelno == logging.WARNING and str(target) in r.getMessage() for r in caplog.records
    )
    store(pool, model, [b"z"], [4], "native")
    load(pool, model, [b"z"], [5], "jax")


def test_torn_record_is_dropped_on_attach(arrays, rng, mesh, path, open_pool, new_name):
    model = make_model(arrays, rng, mesh, "stacked")
    name = new_name()
    pool = open_pool(model.layout, 4, name=name)
    keys = keys_for([0, 1, 2])
    store(pool, model, keys, [0, 1, 2], path)
    pool._records["state"][pool.slot_of(keys[1])] = WRITING  # as a crash mid-write leaves it
    pool.close()
    again = open_pool(model.layout, 4, name=name)
    assert again.attached
    assert again.keys() == [keys[0], keys[2]]
    assert again.stats.torn_discarded == 1
    assert (len(again), again.free) == (2, 2)
    load(again, model, [keys[0], keys[2]], [5, 6], path)
    # the torn slot is free again: the pool fills to its capacity
    assert store(again, model, [b"x", b"y"], [3, 4], path) == 2
    assert again.free == 0
    again.close()
    assert open_pool(model.layout, 4, name=name).stats.torn_discarded == 0


# --- never a wrong byte -------------------------------------------------------------------------


def _corrupt(pool: HostPool, key: bytes, rng: np.random.Generator) -> None:
    """Flips one random byte of one random piece of the key's slot, through views()."""
    slot = pool.slot_of(key)
    index = int(rng.integers(len(pool.layout.arrays)))
    array = pool.layout.arrays[index]
    view = pool.views()[index]
    where: tuple[int, ...] = (*(int(rng.integers(n)) for n in array.outer_shape), slot)
    if array.n_shards > 1:
        where = (int(rng.integers(array.n_shards)), *where)
    raw = view[where].reshape(-1).view(np.uint8)
    assert np.shares_memory(raw, view)
    raw[int(rng.integers(raw.size))] ^= 0x5A
    del raw, view


@pytest.mark.parametrize("kind", ["per-layer", "stacked-sharded"])
def test_corrupt_block_is_a_miss(arrays, rng, mesh, path, open_pool, kind):
    model = make_model(arrays, rng, mesh, kind)
    pool = open_pool(model.layout, 6)
    keys = keys_for([0, 1, 2, 3])
    store(pool, model, keys, [0, 1, 2, 3], path)
    before = slot_payload(pool, keys[1])
    _corrupt(pool, keys[1], rng)
    assert slot_payload(pool, keys[1]) != before

    request = [keys[0], keys[1], b"absent", keys[3]]
    targets = [4, 5, 6, 7]
    with pytest.raises(BlocksMissingError) as info:
        pool.get_to_device(request, model.pools, targets, path=path)
    exc = info.value
    assert exc.loaded == [True, False, False, True]
    assert exc.corrupt == 1
    assert "1 absent" in str(exc) and "1 failed their checksum" in str(exc)
    # the blocks marked loaded are right; the absent key's block was not touched; the corrupt
    # key's block holds whatever was copied (to be recomputed): take it from the device
    model.note_get(request, targets, exc.loaded)
    for i, pool_i in enumerate(model.pools):
        model.current[i][at(model.block_axis, 5)] = np.take(
            np.asarray(pool_i.array), 5, axis=model.block_axis
        )
    model.check("after a get with a corrupt block")
    stats = pool.stats
    assert (stats.checksum_failures, stats.hits, stats.misses) == (1, 2, 2)
    assert stats.bytes_out == 2 * model.layout.payload_bytes
    # the corrupt block is gone; the others stay
    assert pool.contains(keys) == [True, False, True, True]
    assert (len(pool), pool.free) == (3, 3)
    # the key can be stored again, and then it is served
    del model.stored[keys[1]]
    assert store(pool, model, [keys[1]], [1], path) == 1
    load(pool, model, [keys[1], keys[2]], [5, 6], path)


def test_bytes_past_the_payload_are_not_data(arrays, rng, mesh, path, open_pool):
    """A slot's padding up to the page is not part of the block: damage there is no miss."""
    model = make_model(arrays, rng, mesh)
    assert model.layout.payload_bytes < model.layout.slot_bytes
    pool = open_pool(model.layout, 2)
    store(pool, model, [b"a"], [0], path)
    end = pool.geometry.data_offset + (pool.slot_of(b"a") + 1) * model.layout.slot_bytes
    with memoryview(pool._mapping) as memory:
        memory[end - 1] ^= 0xFF
    load(pool, model, [b"a"], [1], path)
    assert pool.stats.checksum_failures == 0


def test_absent_keys(arrays, rng, mesh, path, open_pool):
    model = make_model(arrays, rng, mesh, "sharded")
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"a", b"b"], [0, 1], path)
    with pytest.raises(BlocksMissingError) as info:
        pool.get_to_device([b"b", b"nope", b"a"], model.pools, [2, 3, 4], path=path)
    exc = info.value
    assert isinstance(exc, KeyError) and isinstance(exc, TpuSyncError)
    assert exc.loaded == [True, False, True]
    assert exc.corrupt == 0
    assert str(exc).startswith("keys: 1 of 3 blocks not served")
    model.note_get([b"b", b"nope", b"a"], [2, 3, 4], exc.loaded)
    model.check("after a get with an absent key")  # block 3 untouched
    with pytest.raises(KeyError) as info:  # catchable as the builtin
        pool.get_to_device([b"nope", b"nix"], model.pools, [5, 6], path=path)
    assert info.value.loaded == [False, False]
    model.check("after a get of absent keys only")
    assert pool.keys() == [b"a", b"b"]
    assert (pool.stats.hits, pool.stats.misses, pool.stats.checksum_failures) == (2, 3, 0)
    pool.get_to_device([], model.pools, [], path=path)  # nothing asked, nothing missing


# --- put, delete, capacity ----------------------------------------------------------------------


def test_duplicate_and_present_keys(arrays, rng, mesh, path, open_pool):
    model = make_model(arrays, rng, mesh, "stacked")
    pool = open_pool(model.layout, 4)
    # a key twice in one put: the first occurrence is stored, once
    assert store(pool, model, [b"a", b"b", b"a"], [0, 1, 2], path) == 2
    assert pool.keys() == [b"a", b"b"]
    assert pool.free == 2
    # keys already present are skipped: their blocks are not replaced
    assert store(pool, model, [b"b", b"c", b"a"], [3, 4, 5], path) == 1
    assert pool.keys() == [b"a", b"b", b"c"]
    assert pool.stats.puts == 3
    assert pool.stats.bytes_in == 3 * model.layout.payload_bytes
    assert store(pool, model, [b"a", b"c"], [6, 7], path) == 0
    load(pool, model, [b"a", b"b", b"c"], [5, 6, 7], path)


def test_tier_full_changes_nothing(arrays, rng, mesh, path, open_pool):
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"a", b"b", b"c"], [0, 1, 2], path)
    records = pool._records.copy()
    with pytest.raises(TierFullError) as info:
        pool.put_from_device([b"d", b"a", b"e"], model.pools, [3, 0, 4], path=path)
    assert isinstance(info.value, MemoryError)
    assert "keys" in str(info.value) and "2 new blocks but 1 free" in str(info.value)
    assert pool.keys() == [b"a", b"b", b"c"]
    assert pool.free == 1
    assert pool._records.tobytes() == records.tobytes()
    assert pool.stats.puts == 3
    # a put that fits (present keys do not count) still works
    assert store(pool, model, [b"a", b"d"], [0, 3], path) == 1
    assert pool.free == 0
    with pytest.raises(TierFullError):
        pool.put_from_device([b"e"], model.pools, [4], path=path)
    verify_all(pool, model, path, first_block=4)


def test_delete_frees_slots(arrays, rng, mesh, path, open_pool):
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 3)
    store(pool, model, [b"a", b"b", b"c"], [0, 1, 2], path)
    assert pool.delete([b"b", b"absent", b"b"]) == 1
    assert pool.keys() == [b"a", b"c"]
    assert (pool.free, pool.stats.deletes) == (1, 1)
    assert pool.delete([]) == 0
    del model.stored[b"b"]
    assert store(pool, model, [b"b"], [3], path) == 1  # into the freed slot
    assert pool.keys() == [b"a", b"c", b"b"]
    with pytest.raises(BlocksMissingError):
        pool.get_to_device([b"absent"], model.pools, [4], path=path)
    assert pool.delete([bytearray(b"a"), memoryview(b"c")]) == 2
    assert pool.keys() == [b"b"]
    load(pool, model, [b"b"], [5], path)


def test_delete_skips_blocks_being_read(arrays, rng, mesh, path, open_pool):
    """get_to_device pins its slots for the copy: a delete meanwhile skips them."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 3)
    store(pool, model, [b"a", b"b"], [0, 1], path)
    slot = pool.slot_of(b"a")
    errors: list[BaseException] = []

    def get() -> None:
        try:
            pool.get_to_device([b"a"], model.pools, [5], path=path)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=get)
    with model.pools[0]._lock:  # the copy into this pool waits for the lock
        reader.start()
        deadline = time.monotonic() + TIMEOUT
        while not pool._pins[slot] and reader.is_alive():
            assert time.monotonic() < deadline, "the reader never pinned its slot"
            time.sleep(0.001)
        assert pool.delete([b"a", b"b"]) == 1  # b goes, a is being read
        assert pool.keys() == [b"a"]
    reader.join(TIMEOUT)
    assert not reader.is_alive()
    assert not errors, errors
    model.note_get([b"a"], [5])
    model.check("after the pinned read")
    assert not pool._pins.any()
    assert pool.delete([b"a"]) == 1
    assert (len(pool), pool.free) == (0, 3)


# --- bad input -----------------------------------------------------------------------------------


class Unchanged:
    """The pool's keys, free slots and records, and the device pools' bits, to compare after a
    rejected call."""

    def __init__(self, pool: HostPool, model: Model) -> None:
        self.pool, self.model = pool, model
        self.keys = pool.keys()
        self.free = pool.free
        self.records = pool._records.tobytes()
        self.stats = pool.stats.as_dict()

    def check(self) -> None:
        assert self.pool.keys() == self.keys
        assert self.pool.free == self.free
        assert self.pool._records.tobytes() == self.records
        assert self.pool.stats.as_dict() == self.stats
        self.model.check("after a rejected call")


BAD_CALLS: dict[str, tuple[list[Any], str, list[int], str]] = {
    # case: (keys, which pools, block ids, the argument the error must name)
    "str key": (["a"], "right", [6], "keys[0]"),
    "int key": ([7], "right", [6], "keys[0]"),
    "None key": ([None], "right", [6], "keys[0]"),
    "empty key": ([b""], "right", [6], "keys[0]"),
    "33-byte key": ([b"k" * 33], "right", [6], "keys[0]"),
    "bad second key": ([b"a", "b"], "right", [6, 7], "keys[1]"),
    "too few block ids": ([b"a", b"b"], "right", [6], "block_ids"),
    "too many block ids": ([b"a"], "right", [6, 7], "block_ids"),
    "too few pools": ([b"a"], "too few", [6], "pools"),
    "too many pools": ([b"a"], "too many", [6], "pools"),
    "pools of another layout": ([b"a"], "another layout", [6], "pools"),
    "blocks larger than a slot": ([b"a"], "larger blocks", [6], "pools"),
    "host arrays for pools": ([b"a"], "host arrays", [6], "pools[0]"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
@pytest.mark.parametrize("verb", ["put", "get"])
def test_bad_arguments(arrays, rng, mesh, path, open_pool, verb, case):
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"a", b"b"], [0, 1], path)
    keys, which, block_ids, argument = BAD_CALLS[case]
    pools = {
        "right": model.pools,
        "too few": model.pools[:-1],
        "too many": [*model.pools, model.pools[0]],
        "another layout": [put(np.zeros((NB, 4, 8), BF16)) for _ in model.pools],
        "larger blocks": [put(np.ones((NB, 4, 64), BF16)) for _ in model.pools],
        "host arrays": [np.asarray(p.array) for p in model.pools],
    }[which]
    method = pool.put_from_device if verb == "put" else pool.get_to_device
    unchanged = Unchanged(pool, model)
    with pytest.raises(InvalidArgumentError) as info:
        method(keys, pools, block_ids, path=path)
    assert argument in str(info.value), f"the message does not name {argument!r}: {info.value}"
    unchanged.check()
    load(pool, model, [b"a", b"b"], [2, 3], path)  # still works


@pytest.mark.parametrize("verb", ["put", "get"])
def test_block_ids_out_of_range(arrays, rng, mesh, path, open_pool, verb):
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"a"], [0], path)
    method = pool.put_from_device if verb == "put" else pool.get_to_device
    with pytest.raises(BlockIndexError) as info:
        method([b"a" if verb == "get" else b"new"], model.pools, [NB], path=path)
    assert isinstance(info.value, IndexError)
    assert "block_ids" in str(info.value), info.value
    assert pool.keys() == [b"a"] and pool.free == 3
    assert not pool._pins.any()
    model.check("after a rejected call")
    load(pool, model, [b"a"], [1], path)


def test_bad_keys_for_delete_and_contains(arrays, rng, mesh, open_pool):
    """A non-bytes key is an error everywhere; it never stands for another key (bytes(3) is
    b'\\0\\0\\0')."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"\0\0\0", b"a"], [0, 1], "native")
    for call in (pool.delete, pool.contains):
        for key in (3, "a", None):
            with pytest.raises(InvalidArgumentError) as info:
                call([key])
            assert "keys[0]" in str(info.value)
    assert pool.keys() == [b"\0\0\0", b"a"]


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"capacity": 0}, "capacity"),
        ({"capacity": -3}, "capacity"),
        ({"capacity": 2.0}, "capacity"),
        ({"capacity": "4"}, "capacity"),
        ({"name": "a/b"}, "name"),
        ({"name": "../escape"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 102}, "name"),
        ({"name": "with space"}, "name"),
        ({"on_mismatch": "ignore"}, "on_mismatch"),
        ({"on_mismatch": None}, "on_mismatch"),
        ({"layout": {"model_id": "m"}}, "layout"),
        ({"shm_dir": "/nonexistent/tpusync-test"}, "shm_dir"),
    ],
)
def test_bad_constructor_arguments(new_name, kwargs, argument):
    layout = PoolLayout("m", (ArrayLayout("k", "bfloat16", (4, 16), 0, 1),))
    args = {"layout": layout, "capacity": 4, "name": new_name(), **kwargs}
    with pytest.raises(InvalidArgumentError) as info:
        HostPool(args.pop("layout"), args.pop("capacity"), **args)
    assert argument in str(info.value), f"the message does not name {argument!r}: {info.value}"
    if isinstance(args["name"], str) and "/" not in args["name"]:
        target = pool_path(args["name"])
        assert not target.exists()
        assert not list(target.parent.glob(f".{target.name}.tmp-*"))


@pytest.mark.parametrize("kind", ["per-layer", "sharded"])
def test_prepare_plans_both_directions_and_moves_nothing(arrays, rng, mesh, open_pool, kind):
    """prepare() keeps the plans the first put and get would make, changes no byte on either
    side, and the moves after it are exact; pools of another layout are refused."""
    model = make_model(arrays, rng, mesh, kind)
    pool = open_pool(model.layout, 8)
    store(pool, model, keys_for([0, 1]), [0, 1], "native")
    slots_before = [slot_payload(pool, k) for k in keys_for([0, 1])]
    pool.prepare(model.pools)
    assert set(pool._mover._kept.plans) == {True, False}
    model.check("after prepare")
    assert [slot_payload(pool, k) for k in keys_for([0, 1])] == slots_before
    load(pool, model, keys_for([0, 1]), [3, 2], "native")
    other = make_model(arrays, rng, mesh, "stacked" if kind == "per-layer" else "per-layer")
    with pytest.raises(InvalidArgumentError, match="pools"):
        pool.prepare(other.pools)


def test_use_after_close_is_a_clear_error(arrays, rng, mesh, open_pool):
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    store(pool, model, [b"a"], [0], "native")
    pool.close()
    for call in (
        lambda: pool.put_from_device([b"b"], model.pools, [1]),
        lambda: pool.get_to_device([b"a"], model.pools, [2]),
    ):
        with pytest.raises(TpuSyncError) as info:
            call()
        assert "closed" in str(info.value)
    model.check("after calls on a closed pool")


def test_close_right_after_native_moves_needs_no_garbage_collection(arrays, rng, mesh, open_pool):
    """What a pool keeps for its device pools (plans holding views of its slots) goes when
    close() drops it, not at the next garbage collection: close() succeeds at once."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    gc.disable()
    try:
        store(pool, model, keys_for([0, 1]), [0, 1], "native")
        load(pool, model, keys_for([0, 1]), [3, 2], "native")
        pool.close()
        assert pool.closed
    finally:
        gc.enable()
    model.check("after close")


def test_kept_plans_follow_the_pool_list(arrays, rng, mesh, open_pool):
    """The plans kept for a list of device pools serve that list only: another list (or the
    same pools in another order) is planned anew, and moves with each list stay exact."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 8)
    store(pool, model, keys_for([0, 1]), [0, 1], "native")
    first = pool._mover._kept
    assert first is not None and first.matches(model.pools)
    assert not first.matches(list(reversed(model.pools)))
    other = make_model(arrays, rng, mesh)
    store(pool, other, keys_for([2, 3]), [2, 3], "native")
    assert pool._mover._kept is not first and not pool._mover._kept.matches(model.pools)
    del first
    model.stored.update(other.stored)  # what the first list will load of the other's
    load(pool, model, keys_for([0, 1, 2, 3]), [7, 6, 5, 4], "native")
    assert pool._mover._kept.matches(model.pools)
    model.check("after loads with the first list again")
    other.check("the other list, untouched by them")


def test_puts_from_plain_arrays_keep_nothing(arrays, rng, mesh, open_pool):
    """A put from plain jax.Arrays (not DevicePools) neither replaces what is kept for the
    store's DevicePools nor holds the arrays afterwards."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 8)
    store(pool, model, keys_for([0]), [0], "native")
    kept = pool._mover._kept
    plain = [jax.numpy.array(p.array, copy=True) for p in model.pools]
    watch = weakref.ref(plain[0])
    pool.put_from_device(keys_for([1], "plain"), plain, [1], path="native")
    assert pool._mover._kept is kept and kept.matches(model.pools)
    del plain
    gc.collect()
    assert watch() is None, "the HostPool still holds a plain array it read from"


CLOSE_WITH_VIEWS = """
import numpy as np
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout
layout = PoolLayout("m", (ArrayLayout("k", "float32", (256,), 0, 1),))
pool = HostPool(layout, 64)
view = pool.views()[0]
try:
    pool.close()
except Exception as exc:  # refusing is fine; unmapping under a live view is not
    print("refused:", type(exc).__name__)
view[...] = 1.0
print("ok", float(view.sum()))
"""


def test_close_with_live_views_does_not_crash():
    """close() must not unmap memory that arrays from views() still point into."""
    result = subprocess.run(
        [sys.executable, "-c", CLOSE_WITH_VIEWS],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, f"rc {result.returncode}: {result.stderr[-2000:]}"
    assert "ok" in result.stdout


# --- /dev/shm too small -------------------------------------------------------------------------

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*(bytes|B|KiB|MiB|GiB|kB|KB|MB|GB)\b")
_UNITS = {
    "bytes": 1,
    "B": 1,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "kB": 10**3,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
}


def sizes_in(message: str) -> list[float]:
    return [float(n) * _UNITS[unit] for n, unit in _SIZE.findall(message)]


def mentions_size(message: str, size: int) -> bool:
    return any(abs(s - size) <= 0.03 * size for s in sizes_in(message))


@pytest.fixture
def small_shm(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs (needs root, as in CI); skipped where mounting is not permitted."""
    target = tmp_path / "shm"
    target.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(target)],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    except FileNotFoundError as exc:
        skip_or_fail(f"cannot mount a tmpfs: {exc}")
    if done.returncode != 0:
        skip_or_fail(f"cannot mount a tmpfs: {(done.stderr or done.stdout).strip()}")
    try:
        yield target
    finally:
        # lazy: a pool left open by a failed test must not turn into a second error here
        subprocess.run(["umount", "-l", str(target)], check=True, timeout=TIMEOUT)


def test_shm_too_small(small_shm, new_name):
    layout = PoolLayout("m", (ArrayLayout("k", "float32", (64, 256), 0, 1),))  # 64 KiB slots
    total = os.statvfs(small_shm).f_blocks * os.statvfs(small_shm).f_frsize
    assert total == 2 * 2**20
    name = new_name()
    with pytest.raises(TierFullError) as info:
        HostPool(layout, 64, name=name, shm_dir=str(small_shm))
    exc = info.value
    assert isinstance(exc, MemoryError)
    need = 64 * 64 * 2**10 + 2 * 4096
    message = str(exc)
    assert str(small_shm) in message
    assert mentions_size(message, need), f"the message does not say the pool's size: {message}"
    assert mentions_size(message, total), f"the message does not say the tmpfs' size: {message}"
    assert os.listdir(small_shm) == []  # nothing left behind

    # a pool that fits is made there; a second one no longer fits
    with HostPool(layout, 16, name=name, shm_dir=str(small_shm)) as pool:
        assert pool.path == small_shm / f"tpusync-{name}.pool"
        assert not pool.attached
        with pytest.raises(TierFullError):
            HostPool(layout, 16, name=new_name(), shm_dir=str(small_shm))
    assert [p.name for p in small_shm.iterdir()] == [f"tpusync-{name}.pool"]


# --- concurrency ----------------------------------------------------------------------------------


def test_concurrent_puts_of_one_key_keep_every_slot(arrays, rng, mesh, path, open_pool):
    """Two puts of the same new key at once: one block is stored, and no slot is lost."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 4)
    other = [put(x) for x in model.current]  # same contents, not locked by the test
    errors: list[BaseException] = []

    def first() -> None:
        try:
            pool.put_from_device([b"x"], model.pools, [2], path=path)
        except BaseException as exc:
            errors.append(exc)

    writer = threading.Thread(target=first)
    with model.pools[0]._lock:  # the first put's copy waits here, its slot taken
        writer.start()
        deadline = time.monotonic() + TIMEOUT
        while pool.free == 4:
            assert time.monotonic() < deadline, "the first put never took a slot"
            time.sleep(0.001)
        second = threading.Thread(
            target=lambda: pool.put_from_device([b"x"], other, [2], path=path)
        )
        second.start()
        second.join(1.0)  # may finish (storing or skipping the key) or wait for the first
    writer.join(TIMEOUT)
    second.join(TIMEOUT)
    assert not writer.is_alive() and not second.is_alive(), "deadlock"
    assert not errors, errors
    model.note_put([b"x"], [2])
    assert pool.keys() == [b"x"]
    assert len(pool) + pool.free == pool.capacity, (
        f"{pool.capacity - len(pool) - pool.free} slot(s) lost"
    )
    load(pool, model, [b"x"], [6], path)


def test_many_threads_put_get_delete(arrays, rng, mesh, path, open_pool):
    """Threads storing, loading and deleting shared and private keys on one pool: every block
    served is the one stored under its key (contents are a function of the key), and nothing
    hangs."""
    n_threads, n_shared, n_private, rounds, per_call = 4, 12, 4, 30, 4
    universe = n_shared + n_threads * n_private
    truth = arrays.random(rng, (universe, 4, 16), BF16)
    source = put(truth)
    keys = [f"key-{j:03d}".encode() for j in range(universe)]
    destinations = [DevicePool(put(np.zeros((NB, 4, 16), BF16))) for _ in range(n_threads)]
    layout = PoolLayout.from_pools("concurrent", [source])
    pool = open_pool(layout, 3 * universe)
    seed = int(rng.integers(2**32))
    errors: list[BaseException] = []
    served = [0] * n_threads

    def verify(dst: DevicePool, chosen: list[int], loaded: list[bool]) -> None:
        got = as_bits(dst.array)
        for slot, (j, ok) in enumerate(zip(chosen, loaded, strict=True)):
            if ok and not np.array_equal(got[slot], as_bits(truth[j])):
                raise AssertionError(f"block {slot} loaded for {keys[j]!r} holds other bytes")

    def body(t: int) -> None:
        r = np.random.default_rng([seed, t])
        dst = destinations[t]
        mine = list(range(n_shared + t * n_private, n_shared + (t + 1) * n_private))
        for _ in range(rounds):
            chosen = [int(j) for j in r.choice(n_shared, per_call - 1, replace=False)]
            chosen.append(int(r.choice(mine)))
            r.shuffle(chosen)
            ks = [keys[j] for j in chosen]
            op = r.integers(3)
            if op == 0:
                pool.put_from_device(ks, [source], chosen, path=path)
                assert all(pool.contains([keys[j] for j in chosen if j in mine]))
            elif op == 1:
                private_present = [pool.contains([keys[j]])[0] for j in chosen if j in mine]
                try:
                    pool.get_to_device(ks, [dst], range(per_call), path=path)
                    loaded = [True] * per_call
                except BlocksMissingError as exc:
                    assert exc.corrupt == 0, "a checksum failed"
                    loaded = exc.loaded
                verify(dst, chosen, loaded)
                served[t] += sum(loaded)
                mine_loaded = [ok for j, ok in zip(chosen, loaded, strict=True) if j in mine]
                assert mine_loaded == private_present  # only this thread touches its keys
            else:
                pool.delete(ks)

    def main(t: int) -> None:
        try:
            barrier.wait(TIMEOUT)
            body(t)
        except BaseException as exc:
            errors.append(exc)

    barrier = threading.Barrier(n_threads)
    threads = [threading.Thread(target=main, args=(t,), name=f"pool-{t}") for t in range(n_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not [t.name for t in threads if t.is_alive()], "threads still running (deadlock?)"
    if errors:
        raise errors[0]
    assert sum(served) > 0, "no block was ever served: the test checked nothing"
    assert not pool._pins.any()
    # every key left is served right, and every slot is accounted for
    left = pool.keys()
    dst = destinations[0]
    for start in range(0, len(left), NB):
        chunk = left[start : start + NB]
        pool.get_to_device(chunk, [dst], range(len(chunk)), path=path)
        verify(dst, [keys.index(k) for k in chunk], [True] * len(chunk))
    assert pool.stats.checksum_failures == 0
    assert len(pool) + pool.free == pool.capacity, (
        f"{pool.capacity - len(pool) - pool.free} slot(s) lost"
    )


def test_a_held_block_elsewhere_does_not_fail_a_load(arrays, rng, mesh, path, open_pool):
    """Regression: the first load through a HostPool validated its moves against block 0, so a
    save holding block 0 at that moment made an unrelated load raise BlocksHeldError. Only the
    blocks a transfer writes count; writing a held block is still refused."""
    model = make_model(arrays, rng, mesh)
    source = open_pool(model.layout, 4)
    keys = keys_for([2, 5])
    store(source, model, keys, [2, 5], path)
    for pool in model.pools:
        pool.hold_blocks([0])  # a save still reads block 0
    try:
        fresh = open_pool(model.layout, 4)  # no validated moves kept yet
        fresh_keys = keys_for([2, 5], "again")
        store(fresh, model, fresh_keys, [2, 5], path)
        load(fresh, model, fresh_keys, [6, 7], path)
        with pytest.raises(BlocksHeldError, match="still being saved"):
            fresh.get_to_device(fresh_keys[:1], model.pools, [0], path=path)
    finally:
        for pool in model.pools:
            pool.release_blocks([0])


def test_inline_slot_hashes_equal_the_engine_ones(arrays, rng, mesh, open_pool):
    """hash_slots(inline=True) (the calling thread, one piece at a time) gives the engine's
    checksums, which are the recorded ones."""
    model = make_model(arrays, rng, mesh)
    pool = open_pool(model.layout, 8)
    keys = keys_for([0, 3, 4, 7])
    store(pool, model, keys, [0, 3, 4, 7], "native")
    slots = [pool.slot_of(k) for k in keys]
    engine = pool.hash_slots(slots)
    assert np.array_equal(pool.hash_slots(slots, inline=True), engine)
    assert np.array_equal(engine, pool._records["checksum"][slots])


@pytest.mark.parametrize("populate", [True, False])
def test_wait_mapped_maps_a_reattached_pool_and_keeps_its_blocks(
    arrays, rng, mesh, path, open_pool, new_name, populate
):
    """After a re-attach (pages mapped in the background, or not at all with populate=False),
    wait_mapped returns once every slot is mapped, and the blocks load bit for bit."""
    model = make_model(arrays, rng, mesh)
    name = new_name()
    pool = open_pool(model.layout, 8, name=name)
    keys = keys_for([1, 4, 6])
    store(pool, model, keys, [1, 4, 6], path)
    pool.close()
    pool = open_pool(model.layout, 8, name=name, populate=populate)
    assert pool.attached and pool.wait_mapped(timeout=20)
    assert pool._pages.all_mapped
    load(pool, model, keys, [0, 2, 3], path)


# --- a DRAM pool as a lower tier: slot to slot ----------------------------------------------


def _flip_byte(pool: HostPool, key: bytes) -> None:
    slot = pool.slot_of(key)
    start = pool.geometry.data_offset + slot * pool.layout.slot_bytes + 5
    with memoryview(pool._mapping) as memory:
        memory[start] ^= 0xFF


def test_a_host_pool_is_a_lower_tier_slot_to_slot(arrays, rng, mesh, open_pool, new_name):
    """put(keys, source) and get(keys, target) move blocks between DRAM pools (anonymous and
    named) bit for bit, skip what is there already, and count what they served."""
    from tpusync.tiers import LowerTier

    model = make_model(arrays, rng, mesh, "sharded")
    top = open_pool(model.layout, 6)
    below = open_pool(model.layout, 6, name=new_name())
    again = open_pool(model.layout, 6)
    assert isinstance(below, LowerTier)
    keys = keys_for([0, 3, 5])
    store(top, model, keys, [0, 3, 5], "native")
    assert below.put(keys, top) == 3
    assert below.put([*keys, keys[0]], top) == 0  # all there already
    assert [slot_payload(below, k) for k in keys] == [slot_payload(top, k) for k in keys]
    below.get(keys[::-1], again)
    assert sorted(again.keys()) == sorted(keys)
    assert below.stats.hits == 3 and below.stats.bytes_out == 3 * model.layout.payload_bytes
    load(again, model, keys, [7, 1, 2], "native")  # checksums recorded by the copy hold
    below.get(keys, again)  # already there: loaded, nothing copied


def test_lower_tier_put_refuses_absent_and_corrupt_blocks_storing_nothing(
    arrays, rng, mesh, open_pool
):
    model = make_model(arrays, rng, mesh)
    top = open_pool(model.layout, 4)
    below = open_pool(model.layout, 4)
    keys = keys_for([1, 2])
    store(top, model, keys, [1, 2], "native")
    with pytest.raises(BlocksMissingError) as missing:
        below.put([keys[0], b"nowhere"], top)
    assert missing.value.loaded == [True, False] and below.used == 0
    _flip_byte(top, keys[1])
    with pytest.raises(BlocksMissingError) as corrupt:
        below.put(keys, top)
    assert corrupt.value.corrupt == 1 and corrupt.value.loaded == [True, False]
    assert below.used == 0 and below.free == 4  # nothing stored, no slot leaked
    assert top.contains(keys) == [True, False]  # the corrupt block left its pool
    assert top.stats.checksum_failures == 1
    store(top, model, keys_for([3]), [3], "native")
    tiny = open_pool(model.layout, 1)
    with pytest.raises(TierFullError):
        tiny.put([keys[0], *keys_for([3])], top)
    assert tiny.used == 0 and tiny.free == 1


def test_lower_tier_get_serves_the_good_blocks_and_drops_a_corrupt_one(
    arrays, rng, mesh, open_pool
):
    model = make_model(arrays, rng, mesh)
    below = open_pool(model.layout, 4)
    target = open_pool(model.layout, 4)
    keys = keys_for([0, 4, 6])
    store(below, model, keys, [0, 4, 6], "native")
    _flip_byte(below, keys[1])
    with pytest.raises(BlocksMissingError) as missing:
        below.get([*keys, b"absent"], target)
    assert missing.value.loaded == [True, False, True, False] and missing.value.corrupt == 1
    assert target.contains(keys) == [True, False, True] and target.free == 2
    assert below.contains(keys) == [True, False, True]
    load(target, model, [keys[0], keys[2]], [3, 5], "native")


def test_lower_tier_arguments_are_checked(arrays, rng, mesh, open_pool):
    model = make_model(arrays, rng, mesh)
    other = make_model(arrays, rng, mesh, "stacked")
    pool = open_pool(model.layout, 2)
    with pytest.raises(InvalidArgumentError, match="source: expected a HostPool"):
        pool.put(keys_for([0]), object())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="into itself"):
        pool.get(keys_for([0]), pool)
    with pytest.raises(InvalidArgumentError, match="another block layout"):
        pool.put(keys_for([0]), open_pool(other.layout, 2))
