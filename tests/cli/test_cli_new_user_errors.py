"""What a new user meets in the first hour: errors of the project's standard (a tpusync
exception naming the argument, the values and the fix; a refused call changes nothing), a quiet
library logger, docstrings that are true, and lookup handles that are not leaked silently."""

from __future__ import annotations

import gc
import importlib
import logging
import os
import pkgutil
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mounts import tmpfs

import tpusync
import tpusync._src.kv
import tpusync._src.tiers
import tpusync.kv
import tpusync.tiers
from tpusync import DevicePool, errors
from tpusync.errors import (
    DtypeMismatchError,
    InvalidArgumentError,
    ShapeMismatchError,
    TpuSyncError,
)
from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout, SharedFsPool

BF16 = np.dtype(ml_dtypes.bfloat16)
NB, BS, HEADS, DIM = 32, 16, 2, 8  # device pools of the KV store tests: (NB, BS, HEADS, DIM)
TIMEOUT = 60.0


@jax.jit
def _computed(array: jax.Array) -> jax.Array:
    """A JAX computation's output (what DevicePool.update takes): a copy of ``array``."""
    return array + jnp.zeros((), array.dtype)


def _bits(pool: DevicePool) -> np.ndarray:
    return np.array(np.asarray(pool.array).view(np.uint8), copy=True)


def _refused(call: Any, error: type[TpuSyncError], *parts: str) -> str:
    """``call()`` raises ``error`` whose message contains every one of ``parts``."""
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for part in parts:
        assert part in message, f"{part!r} is not in the message: {message}"
    return message


# --- 1. DevicePool.update(numpy) ------------------------------------------------------------------


def test_update_with_a_numpy_array_is_refused_naming_the_argument(arrays, rng):
    """The ownership contract (module docstring of tpusync._src.memory.device_pool) says update()
    takes arrays a JAX computation returned: numpy is refused with the argument named, not an
    AttributeError, and the pool keeps its array."""
    pool = DevicePool(jax.device_put(arrays.random(rng, (8, 4), np.float32)))
    before, array = _bits(pool), pool.array
    for bad in (arrays.random(rng, (8, 4), np.float32), [[1.0] * 4] * 8, None):
        message = _refused(
            lambda b=bad: pool.update(b), InvalidArgumentError, "array: ", "jax.Array"
        )
        assert message.startswith("array: DevicePool.update takes a jax.Array"), message
        assert type(bad).__name__ in message
        with pytest.raises(ValueError) as info:  # the builtin it also is
            pool.update(bad)
        assert isinstance(info.value, TpuSyncError)
    assert pool.array is array
    np.testing.assert_array_equal(_bits(pool), before)


# --- 2. DevicePool.update with another dtype ------------------------------------------------------


def test_update_with_another_dtype_is_a_dtype_error_naming_both(arrays, rng):
    """A bf16 array of the right shape into a float32 pool: DtypeMismatchError (not a shape
    error) naming both dtypes and both shapes; the pool is unchanged."""
    pool = DevicePool(jax.device_put(arrays.random(rng, (8, 4), np.float32)))
    before, array = _bits(pool), pool.array
    for shape in ((8, 4), (8, 5)):
        bad = _computed(jax.device_put(arrays.random(rng, shape, BF16)))
        with pytest.raises(DtypeMismatchError) as info:
            pool.update(bad)
        assert not isinstance(info.value, ShapeMismatchError)
        message = str(info.value)
        assert message.startswith("array: "), message
        for part in ("float32", "bfloat16", "(8, 4)", str(shape)):
            assert part in message, f"{part!r} is not in the message: {message}"
    assert pool.array is array
    np.testing.assert_array_equal(_bits(pool), before)
    good = _computed(pool.array)
    pool.update(good)  # the right dtype, shape and sharding is still taken
    assert pool.array is good


# --- 3. DiskPool in a directory it cannot use -----------------------------------------------------


def _layout() -> PoolLayout:
    return PoolLayout(
        "first-hour", tuple(ArrayLayout(n, "bfloat16", (16, 256), 0, 1) for n in "kv")
    )


def test_disk_pool_names_a_directory_it_cannot_use(tmp_path):
    """/proc, a missing path, a file and a read-only mount: InvalidArgumentError naming the
    ``directory`` argument, the path and the fix, before anything is made there."""
    missing = tmp_path / "missing"
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"keep me")
    cases = [
        ("/proc", "cannot create files in /proc", "give a writable directory"),
        (missing, f"{missing} does not exist", "create it (or mount its filesystem) first"),
        (a_file, f"{a_file} is not a directory", "give a directory"),
    ]
    for path, what, fix in cases:
        message = _refused(
            lambda p=path: DiskPool(_layout(), 10, p), InvalidArgumentError, what, fix
        )
        assert message.startswith("directory: "), message
        with pytest.raises(ValueError):  # the builtin it also is
            DiskPool(_layout(), 10, path)
    assert not missing.exists()
    assert a_file.read_bytes() == b"keep me"
    with tmpfs(tmp_path / "read-only", "size=1m,ro") as read_only:
        _refused(
            lambda: DiskPool(_layout(), 10, read_only),
            InvalidArgumentError,
            f"directory: cannot create files in {read_only}",
            "give a writable directory",
        )
        assert not os.listdir(read_only)


# --- 4. closed pools do not answer with plausible numbers -----------------------------------------


def _fill(host: HostPool, keys: list[bytes], rng: np.random.Generator) -> None:
    reservation = host.reserve(keys)
    n = host.layout.payload_bytes
    for slot in reservation.slots.tolist():
        with host.slot_memory(slot) as memory:
            np.frombuffer(memory, np.uint8)[:n] = rng.integers(1, 256, n, dtype=np.uint8)
    host.commit(reservation, host.hash_slots(reservation.slots))


def _closed_answers(pool: Any, *questions: str) -> None:
    """Every question (an attribute, or a call ``name()``) raises PoolClosedError (read from
    the module in the test, so that only this test fails where it is missing) naming the
    pool; its repr still works and says it is closed."""
    for question in questions:
        with pytest.raises(errors.PoolClosedError, match="is closed") as info:
            if question.endswith("()"):
                getattr(pool, question[:-2])()
            elif question == "len":
                len(pool)
            else:
                getattr(pool, question)
        assert isinstance(info.value, InvalidArgumentError) and isinstance(info.value, ValueError)
        assert type(pool).__name__ in str(info.value) or "disk pool" in str(info.value)
    assert "closed" in repr(pool)


def test_closed_pools_raise_instead_of_counting(tmp_path, rng):
    """HostPool, DiskPool and SharedFsPool after close(): used, free, len, keys and contains
    raise PoolClosedError (they answered 0 or stale counts); capacity, a setting, still
    answers. A reopened pool finds its blocks as they were."""
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "shared").mkdir(mode=0o700)
    with HostPool(_layout(), 8) as source:
        _fill(source, keys, rng)
        disk = DiskPool(_layout(), 8, tmp_path / "disk")
        shared = SharedFsPool(_layout(), tmp_path / "shared")
        assert disk.put(keys, source) == 3 and shared.put(keys, source) == 3
        disk.close()
        shared.close()
    source.close()  # again: close is idempotent
    _closed_answers(source, "used", "free", "len", "keys()")
    with pytest.raises(errors.PoolClosedError, match=r"HostPool \(anonymous\) is closed"):
        source.contains(keys)
    _closed_answers(disk, "used", "free", "usable_capacity", "len", "keys()")
    with pytest.raises(
        errors.PoolClosedError, match=rf"disk pool in {tmp_path / 'disk'} is closed"
    ):
        disk.contains(keys)
    _closed_answers(shared, "used", "keys()")
    with pytest.raises(errors.PoolClosedError):
        shared.contains(keys)
    assert (source.capacity, disk.capacity, shared.capacity) == (8, 8, sys.maxsize)
    assert source and disk and shared  # still true: `if pool:` never raises
    with DiskPool(_layout(), 8, tmp_path / "disk") as again:
        assert again.used == 3 and sorted(again.keys()) == sorted(keys)
    with SharedFsPool(_layout(), tmp_path / "shared") as again:
        assert again.used == 3


# --- 5. the library's logger ----------------------------------------------------------------------


def test_library_logger_has_a_null_handler():
    """``tpusync`` has a NullHandler: without an application handler, a warning is not printed
    through logging.lastResort."""
    handlers = logging.getLogger("tpusync").handlers
    assert any(type(h) is logging.NullHandler for h in handlers), handlers
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "import logging, tpusync; logging.getLogger('tpusync.tiers').warning('first hour')",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert child.returncode == 0, child.stderr
    assert "first hour" not in child.stderr, child.stderr


# --- 6. the tier docstrings -----------------------------------------------------------------------


def test_tier_docstrings_promise_nothing_that_exists_already():
    """No module of tpusync.tiers (nor tpusync.kv) calls a tier "to come" or "not yet" there:
    the disk and shared-filesystem tiers exist and are exported."""
    assert tpusync.tiers.DiskPool is DiskPool and tpusync.tiers.SharedFsPool is SharedFsPool
    stale = ("to come", "will come", "not yet implemented", "coming soon")
    for package in (tpusync._src.tiers, tpusync._src.kv):
        names = [package.__name__] + [
            m.name for m in pkgutil.walk_packages(package.__path__, f"{package.__name__}.")
        ]
        for name in names:
            doc = (importlib.import_module(name).__doc__ or "").lower()
            for phrase in stale:
                assert phrase not in doc, f"{name}'s docstring says {phrase!r}"


# --- 7. lookup handles dropped without load or release --------------------------------------------


def _store(arrays: Any, rng: np.random.Generator) -> tuple[KVCacheStore, list[int]]:
    """A DRAM-only store holding one 3-block prompt (48 of its 53 tokens cached)."""
    pools = [
        DevicePool(jax.device_put(arrays.random(rng, (NB, BS, HEADS, DIM), BF16)), name=f"p{i}")
        for i in range(2)
    ]
    config = KVStoreConfig(
        model_id="first-hour",
        block_size=BS,
        dram=DramTier(8, populate=False),
    )
    store = KVCacheStore(config, pools)
    tokens = rng.integers(0, 50_000, size=3 * BS + 5).tolist()
    store.save(tokens, [0, 1, 2])
    return store, tokens


def _open_handles(store: KVCacheStore) -> int:
    return store.stats()["store"]["open_handles"]


DROPPED = r"never loaded or released \(a hit of 3 blocks, 48 of 53 tokens\).*store\.release"


def test_a_dropped_handle_warns_and_releases_its_pins(arrays, rng):
    """A handle garbage collected unconsumed warns (ResourceWarning naming its blocks and
    tokens, and the fix) and its pins go: its blocks can be evicted again."""
    store, tokens = _store(arrays, rng)
    try:
        hit = store.lookup(tokens)
        assert hit.num_blocks == 3 and _open_handles(store) == 1
        assert store.evict(tokens) == 0  # pinned
        with pytest.warns(ResourceWarning, match=DROPPED):
            del hit
            gc.collect()
        assert _open_handles(store) == 0
        assert store.evict(tokens) == 3  # no pin left
    finally:
        store.close()


def test_a_handle_collected_in_a_cycle_warns_and_releases_its_pins(arrays, rng):
    """The same when the cyclic GC collects it (which may run while the store holds its locks:
    the pins then go at the store's next call)."""
    store, tokens = _store(arrays, rng)
    try:
        hit = store.lookup(tokens)
        cycle: list[Any] = [hit]
        cycle.append(cycle)
        hit.cycle = cycle  # type: ignore[attr-defined]
        with pytest.warns(ResourceWarning, match=DROPPED):
            del hit, cycle
            gc.collect()
        assert store.evict(tokens) == 3
    finally:
        store.close()


def test_consumed_handles_and_misses_do_not_warn(arrays, rng):
    """Loaded, released and context-managed handles, and a miss (it pins nothing), are dropped
    without a warning."""
    store, tokens = _store(arrays, rng)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store.load(store.lookup(tokens), [10, 11, 12])
            store.release(store.lookup(tokens))
            with store.lookup(tokens) as hit:
                assert hit.num_blocks == 3
            miss = store.lookup([7] * BS)
            assert miss.num_blocks == 0
            del hit, miss
            gc.collect()
            assert _open_handles(store) == 0
            store.close()
        assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    finally:
        store.close()


def test_close_reports_and_releases_open_handles(arrays, rng):
    """close() with handles still open: one ResourceWarning counting those holding pins;
    they become invalid."""
    store, tokens = _store(arrays, rng)
    try:
        first, second = store.lookup(tokens), store.lookup(tokens)
        miss = store.lookup([7] * BS)
        store.release(store.lookup(tokens))
        with pytest.warns(ResourceWarning, match=r"close\(\): 2 lookup handles still open"):
            store.close()
        assert not first.open and not second.open and not miss.open
        del first, second, miss
        gc.collect()  # detached: no second warning when they go
    finally:
        store.close()


def test_handles_dropped_from_many_threads_release_every_pin(arrays, rng):
    """Threads looking up, releasing and dropping handles at once: every dropped one warns once
    and, at the end, no pin and no open handle is left."""
    store, tokens = _store(arrays, rng)
    try:
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for i in range(40):
                    hit = store.lookup(tokens)
                    if i % 2:
                        store.release(hit)
                    del hit  # the other half is dropped
            except BaseException as error:
                errors.append(error)

        with pytest.warns(ResourceWarning, match=DROPPED) as caught:
            threads = [threading.Thread(target=work) for _ in range(4)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(TIMEOUT)
            gc.collect()
        assert not errors, errors
        assert sum(issubclass(w.category, ResourceWarning) for w in caught) == 4 * 20
        assert _open_handles(store) == 0
        assert store.evict(tokens) == 3
    finally:
        store.close()


EXIT_SCRIPT = """
import jax, numpy as np
from tpusync import DevicePool
from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig
pools = [DevicePool(jax.device_put(np.ones((8, 16, 2, 8), np.float32)))]
config = KVStoreConfig(model_id="exit", block_size=16, dram=DramTier(4, populate=False))
store = KVCacheStore(config, pools)
store.save(list(range(32)), [0, 1])
KEPT = store.lookup(list(range(32)))  # a global: alive until the interpreter exits
assert KEPT.num_blocks == 2
print("ok", flush=True)
"""


def test_a_handle_alive_at_interpreter_exit_is_quiet(tmp_path: Path):
    """A handle still referenced when the interpreter exits: no warning, no error at exit."""
    child = subprocess.run(
        [sys.executable, "-W", "error", "-c", EXIT_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert child.returncode == 0 and child.stdout == "ok\n", child.stderr
    assert "Warning" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr
