"""KVCacheStore: prefix caching of paged KV blocks over DRAM, disk and a shared filesystem.

Every test runs real tiers: anonymous or named (/dev/shm, unique names, removed afterwards) DRAM
pools, DiskPool and SharedFsPool in the test's temporary directory, and real DevicePools on the
fake CPU devices (4 pools of 64 blocks of (16 tokens, 2 heads, 8 dims) of random bits). Loaded
blocks are compared bit for bit with what the saved device blocks held, and every other device
block is checked untouched.

A few tests reach into the tier stack (``store._stack``) to look at where a block rests, or hold
one of its room locks to keep a save or the write-back in flight deterministically (no sleeps
racing threads); they say so where they do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpusync
from tpusync import DevicePool
from tpusync._src.kv.keys import check_tokens
from tpusync._src.tiers.disk.pool import HEADER_BYTES as DISK_HEADER_BYTES
from tpusync._src.tiers.dram import pool_path
from tpusync._src.tiers.shared_fs.pool import HEADER_BYTES as SHARED_HEADER_BYTES
from tpusync.errors import (
    BlockIndexError,
    BlocksHeldError,
    InvalidArgumentError,
    NamespaceMismatchError,
    PoolBusyError,
    SessionNotFoundError,
    StaleHandleError,
    TierFullError,
    TpuSyncError,
)
from tpusync.kv import (
    DiskTier,
    DramTier,
    KVCacheStore,
    KVStoreConfig,
    LoadResult,
    LookupResult,
    SaveFuture,
    SaveResult,
    SessionRestore,
    SharedFsTier,
)

NB, BS, HEADS, DIM, N_POOLS = 64, 16, 2, 8, 4  # device pools: (NB, BS, HEADS, DIM) each
BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
DTYPES = [np.dtype(np.float32), BF16, np.dtype(np.int8), E4M3]
TIMEOUT = 60.0
VOCAB = 50_000


# --- device pools with snapshots ---------------------------------------------------------------


class Kv:
    """The engine's KV arrays: device pools of random bits, read back as bits."""

    def __init__(
        self, arrays: Any, rng: np.random.Generator, dtype: Any = BF16, blocks: int = NB, bs=BS
    ) -> None:
        self.arrays, self.rng, self.dtype, self.bs = arrays, rng, np.dtype(dtype), bs
        self.pools = [
            DevicePool(
                jax.device_put(arrays.random(rng, (blocks, bs, HEADS, DIM), dtype)),
                name=f"kv{i}",
            )
            for i in range(N_POOLS)
        ]

    def snapshot(self) -> list[np.ndarray]:
        return [np.array(self.arrays.bits(p.array), copy=True) for p in self.pools]

    def blocks(self, ids: Any) -> list[np.ndarray]:
        ids = list(ids)
        return [b[ids] for b in self.snapshot()]

    def write(self, ids: Any) -> None:
        """Fresh random bits into device blocks ``ids`` (what a model step would do)."""
        ids = list(ids)
        for pool in self.pools:
            src = self.arrays.random(self.rng, (len(ids), self.bs, HEADS, DIM), self.dtype)
            tpusync.transfer(src, pool, dst_blocks=ids).result(TIMEOUT)

    def held(self) -> list[list[int]]:
        return [p.held_blocks() for p in self.pools]

    def check(
        self,
        dst: Any,
        expected: list[np.ndarray],
        before: list[np.ndarray] | None = None,
        written: Any = (),
    ) -> None:
        """Blocks ``dst`` hold ``expected``; with ``before``, every other block but those in
        ``written`` (targets of a load past its valid prefix) is unchanged."""
        dst = list(dst)
        now = self.snapshot()
        for i in range(N_POOLS):
            self.arrays.assert_same(now[i][dst], expected[i], f"pool {i}, blocks {dst}")
            if before is not None:
                rest = np.setdiff1d(np.arange(now[i].shape[0]), [*dst, *written])
                self.arrays.assert_same(now[i][rest], before[i][rest], f"pool {i}, other blocks")


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def make_config(
    tmp_path: Path | None = None,
    dram: int = 16,
    *,
    disk: int | None = None,
    shared: bool | int = False,
    name: str | None = None,
    **kwargs: Any,
) -> KVStoreConfig:
    assert tmp_path is not None or (disk is None and not shared)
    tiers: list[Any] = []
    if disk:
        tiers.append(DiskTier(tmp_path / "disk", disk, create=True))
    if shared:
        capacity = None if shared is True else int(shared)
        tiers.append(SharedFsTier(tmp_path / "shared", capacity, create=True))
    return KVStoreConfig(
        model_id="test-model",
        block_size=BS,
        dram=DramTier(dram, name=name, populate=False),
        tiers=(*tiers, *kwargs.pop("tiers", ())),
        **kwargs,
    )


def prompt(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(0, VOCAB, size=n).tolist()


def keys_of(store: KVCacheStore, tokens: Any, namespace: Any = None) -> list[bytes]:
    return store.scheme.block_keys(namespace or store.namespace, check_tokens(tokens), BS)


def hits(store: KVCacheStore, tokens: Any, namespace: Any = None) -> tuple[int, tuple[str, ...]]:
    """(cached blocks, tiers) of a lookup, released at once."""
    with store.lookup(tokens, namespace=namespace) as result:
        return result.num_blocks, result.tiers


def counters(store: KVCacheStore) -> dict[str, Any]:
    return store.stats()["store"]


# --- save, lookup, load -------------------------------------------------------------------------


@pytest.mark.parametrize("tiers", ["dram", "disk+shared"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_save_lookup_load_round_trip(arrays, rng, stores, tmp_path, dtype, tiers):
    kv = Kv(arrays, rng, dtype)
    lower = tiers != "dram"
    store = stores(make_config(tmp_path, 16, disk=16 if lower else None, shared=lower), kv.pools)
    tokens = prompt(rng, 5 * BS + 7)
    src = [3, 9, 1, 20, 33, 40]  # block 40 holds the partial block: never saved
    expected = kv.blocks(src[:5])

    saved = store.save(tokens, src)
    assert isinstance(saved, SaveResult)
    assert (saved.stored_blocks, saved.skipped_blocks) == (5, 0)
    assert saved.bytes == 5 * store.layout.payload_bytes
    assert store.dram.used == 5  # the partial block is not saved
    assert kv.held() == [[]] * N_POOLS
    assert store.flush(TIMEOUT)
    if lower:
        for tier in store._stack.tiers[1:]:
            assert sorted(tier.keys()) == sorted(keys_of(store, tokens))

    hit = store.lookup(tokens)
    assert isinstance(hit, LookupResult)
    assert (hit.cached_tokens, hit.total_tokens, hit.num_blocks) == (5 * BS, 5 * BS + 7, 5)
    assert hit.tiers == ("dram",) * 5
    assert hit.keys == tuple(keys_of(store, tokens))
    assert hit.open
    before = kv.snapshot()
    dst = [50, 51, 60, 2, 7]
    loaded = store.load(hit, dst)
    assert isinstance(loaded, LoadResult)
    assert (loaded.loaded_tokens, loaded.loaded_blocks, loaded.requested_blocks) == (80, 5, 5)
    assert (loaded.bytes, loaded.promoted_blocks) == (5 * store.layout.payload_bytes, 0)
    assert not hit.open
    kv.check(dst, expected, before)
    kv.check(src[:5], expected)  # the source blocks are as they were

    other_tail = tokens[: 4 * BS] + prompt(rng, 40)
    assert hits(store, tokens + prompt(rng, 3 * BS)) == (5, ("dram",) * 5)  # a longer prompt
    assert hits(store, other_tail)[0] == 4  # same first 4 blocks, then another block 5
    assert hits(store, tokens[: 5 * BS]) == (5, ("dram",) * 5)
    assert hits(store, tokens[: 5 * BS - 1])[0] == 4
    assert hits(store, tokens[: BS - 1]) == (0, ())  # shorter than a block: nothing
    assert hits(store, [tokens[0] + 1, *tokens[1:]]) == (0, ())  # another first token
    assert hits(store, []) == (0, ())
    empty = store.lookup(tokens[:10])
    assert (empty.cached_tokens, empty.total_tokens, empty.keys) == (0, 10, ())
    nothing = store.load(empty, [])
    assert (nothing.loaded_tokens, nothing.requested_blocks) == (0, 0)
    assert counters(store)["open_handles"] == 0


@pytest.mark.parametrize("dtype", [BF16, E4M3, np.dtype(np.float32)], ids=str)
def test_round_trip_on_each_path(arrays, rng, stores, path, dtype):
    """Both engines move bits (NaN payloads included: block 0 of every pool holds them)."""
    kv = Kv(arrays, rng, dtype)
    store = stores(make_config(None, 8, path=path), kv.pools)
    tokens = prompt(rng, 3 * BS)
    expected = kv.blocks([0, 5, 6])
    assert store.save(tokens, [0, 5, 6]).stored_blocks == 3
    before = kv.snapshot()
    hit = store.lookup(tokens)
    assert store.load(hit, [10, 11, 12]).loaded_blocks == 3
    kv.check([10, 11, 12], expected, before)


def test_warmup_changes_no_byte_and_loads_after_it_are_exact(arrays, rng, stores):
    """warmup() (what an engine calls at start-up) plans and compiles but moves nothing."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 2 * BS)
    expected = kv.blocks([3, 4])
    store.save(tokens, [3, 4])
    before = kv.snapshot()
    store.warmup()
    store.warmup()  # again: still nothing moves
    assert same(kv.snapshot(), before)
    hit = store.lookup(tokens)
    assert store.load(hit, [7, 8]).loaded_blocks == 2
    kv.check([7, 8], expected, before)


def test_load_fewer_blocks_than_the_hit(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 4), kv.pools)
    tokens = prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    before = kv.snapshot()
    hit = store.lookup(tokens)
    result = store.load(hit, np.array([30, 31], dtype=np.int32))
    assert (result.loaded_tokens, result.loaded_blocks, result.requested_blocks) == (32, 2, 2)
    kv.check([30, 31], [e[:2] for e in expected], before)
    # every pin was dropped: 4 new blocks evict all 4
    store.save(prompt(rng, 4 * BS), [4, 5, 6, 7])
    assert hits(store, tokens) == (0, ())


def test_load_skips_the_first_blocks_of_the_hit(arrays, rng, stores, tmp_path):
    """A sliding window's engine needs only the blocks from its window on: ``skip_blocks``
    loads the hit's later blocks (from DRAM, and from disk by the async form), leaves the
    device blocks it was not given untouched and drops every pin."""
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 8, disk=16), kv.pools)
    tokens = prompt(rng, 5 * BS)
    expected = kv.blocks([0, 1, 2, 3, 4])
    store.save(tokens, [0, 1, 2, 3, 4])
    before = kv.snapshot()
    hit = store.lookup(tokens)
    for bad in (-1, 6, 1.0, True):
        with pytest.raises(InvalidArgumentError, match="skip_blocks: expected 0 to the hit's 5"):
            store.load(hit, [40], skip_blocks=bad)
    with pytest.raises(InvalidArgumentError, match="4 block ids for a hit of 3 blocks"):
        store.load(hit, [40, 41, 42, 43], skip_blocks=2)  # 3 blocks after the 2 skipped
    assert hit.open  # refused: nothing moved, nothing released
    result = store.load(hit, [40, 41], skip_blocks=3)
    assert (result.loaded_blocks, result.requested_blocks, result.loaded_tokens) == (2, 2, 32)
    kv.check([40, 41], [e[3:5] for e in expected], before)
    assert store.stats()["store"]["open_handles"] == 0
    assert store.flush(TIMEOUT)  # written through to disk
    store.save(prompt(rng, 8 * BS), list(range(8, 16)))  # evicts all five from DRAM
    assert store.flush(TIMEOUT)
    assert hits(store, tokens) == (5, ("disk",) * 5)
    before = kv.snapshot()
    hit = store.lookup(tokens)
    done = store.load_async(hit, [50, 51, 52, 53], skip_blocks=1).result(TIMEOUT)
    assert done.loaded_blocks == 4
    kv.check([50, 51, 52, 53], [e[1:5] for e in expected], before)


@pytest.mark.parametrize(("field", "value"), [("weight_version", "1"), ("salt", b"1")])
def test_lookup_reports_the_tier_of_each_block(arrays, rng, stores, tmp_path, field, value):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=8, shared=True), kv.pools)
    ns = dataclasses.replace(store.namespace, **{field: value})
    a, b = prompt(rng, 4 * BS), prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(a, [0, 1, 2, 3], namespace=ns)
    assert store.flush(TIMEOUT)
    store.save(b, [4, 5, 6, 7])  # evicts a from DRAM: it rests on disk and the shared FS
    assert store.flush(TIMEOUT)
    keys = keys_of(store, a, ns)
    assert store.dram.contains(keys) == [False] * 4
    assert hits(store, a) == (0, ())  # another namespace
    assert hits(store, a, ns) == (4, ("disk",) * 4)
    store._stack.tiers[1].delete([keys[2]])  # white box: block 2 now only on the shared FS
    assert hits(store, a, ns) == (4, ("disk", "disk", "shared_fs", "disk"))
    before = kv.snapshot()
    hit = store.lookup(a, namespace=ns)
    result = store.load(hit, [40, 41, 42, 43])
    assert (result.loaded_blocks, result.promoted_blocks) == (4, 4)
    kv.check([40, 41, 42, 43], expected, before)
    assert hits(store, a, ns) == (4, ("dram",) * 4)
    assert counters(store)["promotions"] == 4


# --- handles ------------------------------------------------------------------------------------


@pytest.fixture
def saved(arrays, rng, stores):
    """A DRAM-only store of 6 slots holding one 3-block prompt saved from device blocks 0..2."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 6), kv.pools)
    tokens = prompt(rng, 3 * BS + 5)
    expected = kv.blocks([0, 1, 2])
    store.save(tokens, [0, 1, 2])
    return kv, store, tokens, expected


def test_load_consumes_the_handle(saved):
    kv, store, tokens, expected = saved
    hit = store.lookup(tokens)
    assert counters(store)["open_handles"] == 1
    store.load(hit, [10, 11, 12])
    assert counters(store)["open_handles"] == 0
    with pytest.raises(StaleHandleError, match=r"^result: .*loaded"):
        store.load(hit, [20, 21, 22])
    with pytest.raises(StaleHandleError, match=r"^result: .*loaded"):
        store.release(hit)
    with pytest.raises(StaleHandleError, match=r"^result: "):
        store.load_async(hit, [20, 21, 22])
    kv.check([10, 11, 12], expected)
    assert not same(kv.blocks([20, 21, 22]), expected)  # the stale loads wrote nothing


def test_release_consumes_the_handle(saved):
    kv, store, tokens, _ = saved
    hit = store.lookup(tokens)
    store.release(hit)
    assert not hit.open
    assert counters(store)["open_handles"] == 0
    before = kv.snapshot()
    with pytest.raises(StaleHandleError, match=r"^result: .*released"):
        store.release(hit)
    with pytest.raises(StaleHandleError, match=r"^result: .*released"):
        store.load(hit, [10, 11, 12])
    assert same(kv.snapshot(), before)
    with pytest.raises(InvalidArgumentError, match=r"^result: expected the LookupResult"):
        store.release("not a handle")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"^result: expected the LookupResult"):
        store.load(None, [1])  # type: ignore[arg-type]


def test_handle_of_another_store(saved, stores):
    kv, store, tokens, expected = saved
    other = stores(make_config(None, 6), kv.pools)
    other.save(tokens, [0, 1, 2])
    theirs = other.lookup(tokens)
    with pytest.raises(StaleHandleError, match=r"another KVCacheStore"):
        store.load(theirs, [10, 11, 12])
    with pytest.raises(StaleHandleError, match=r"another KVCacheStore"):
        store.release(theirs)
    assert theirs.open  # still good where it belongs
    assert other.load(theirs, [10, 11, 12]).loaded_blocks == 3
    kv.check([10, 11, 12], expected)


def test_handle_context_manager_releases(saved, rng):
    kv, store, tokens, expected = saved
    with store.lookup(tokens) as hit:
        assert hit.open and counters(store)["open_handles"] == 1
    assert not hit.open
    assert counters(store)["open_handles"] == 0
    with pytest.raises(StaleHandleError):
        store.load(hit, [10, 11, 12])
    with store.lookup(tokens) as hit:  # loaded inside: no release on exit
        store.load(hit, [10, 11, 12])
    kv.check([10, 11, 12], expected)
    with pytest.raises(RuntimeError, match="boom"), store.lookup(tokens) as hit:
        raise RuntimeError("boom")
    assert not hit.open
    # no pin is left behind: 6 new blocks evict the 3 cached ones
    store.save(prompt(rng, 6 * BS), [20, 21, 22, 23, 24, 25])
    assert hits(store, tokens) == (0, ())


FAILED_LOADS = {
    "out of range": ([10, 11, NB], BlockIndexError, r"^device_block_ids: ids must be in 0\.\."),
    "negative": ([-1, 10, 11], BlockIndexError, r"^device_block_ids: ids must be in 0\.\."),
    "duplicated": ([10, 11, 10], BlockIndexError, r"^device_block_ids: .*more than once"),
    "too many": ([10, 11, 12, 13], InvalidArgumentError, r"^device_block_ids: 4 block ids"),
    "float": ([10.0, 11.0, 12.0], InvalidArgumentError, r"^device_block_ids: .*integer"),
    "held": ([10, 11, 12], BlocksHeldError, r"^device_block_ids: blocks \[11\]"),
}


@pytest.mark.parametrize("case", FAILED_LOADS, ids=list(FAILED_LOADS))
def test_failed_load_keeps_the_handle_and_its_pins(saved, rng, case):
    kv, store, tokens, expected = saved
    ids, error, message = FAILED_LOADS[case]
    hit = store.lookup(tokens)
    if case == "held":
        kv.pools[2].hold_blocks([11])  # as a save still reading block 11 would
    before = kv.snapshot()
    try:
        with pytest.raises(error, match=message):
            store.load(hit, ids)
    finally:
        if case == "held":
            kv.pools[2].release_blocks([11])
    assert hit.open
    assert counters(store)["open_handles"] == 1
    assert same(kv.snapshot(), before)  # nothing was written

    # heavy eviction pressure: 3 free slots, cycled through by 12 saves; the pinned 3 stay
    for i in range(12):
        assert store.save(prompt(rng, 3 * BS), [30 + i, 45, 50]).stored_blocks == 3
    with pytest.raises(TierFullError):
        store.save(prompt(rng, 4 * BS), [1, 2, 3, 4])
    assert store.dram.contains(list(hit.keys)) == [True] * 3

    before = kv.snapshot()
    result = store.load(hit, [10, 11, 12])
    assert result.loaded_tokens == 3 * BS
    kv.check([10, 11, 12], expected, before)
    assert store.save(prompt(rng, 4 * BS), [1, 2, 3, 4]).stored_blocks == 4  # pins are gone


def test_pinned_blocks_are_never_evicted(saved, rng):
    kv, store, tokens, expected = saved  # 6 slots, 3 used
    hit = store.lookup(tokens)
    other = prompt(rng, 4 * BS)
    future = store.save_async(other, [20, 21, 22, 23])  # needs 4 slots: only 3 can be had
    with pytest.raises(TierFullError) as info:
        future.result(TIMEOUT)
    assert isinstance(info.value, MemoryError)
    assert "release handles" in str(info.value)
    assert future.released.done()  # the device blocks are the engine's again
    assert kv.held() == [[]] * N_POOLS
    assert store.dram.used == 3
    assert hits(store, other) == (0, ())
    with pytest.raises(TierFullError):
        store.save(other, [20, 21, 22, 23])
    assert store.save(other[: 3 * BS], [20, 21, 22]).stored_blocks == 3  # 3 free slots: fine
    before = kv.snapshot()
    assert store.load(hit, [40, 41, 42]).loaded_blocks == 3
    kv.check([40, 41, 42], expected, before)
    assert store.save(other, [20, 21, 22, 23]).stored_blocks == 1  # evicts one block now


def test_a_save_that_cannot_fit_evicts_nothing(saved, rng):
    """A save that fails with TierFullError changes nothing: the unpinned blocks it could have
    evicted (too few for it) stay cached."""
    kv, store, tokens, _ = saved  # 6 slots, 3 used
    hit = store.lookup(tokens)  # pins 3
    other = prompt(rng, 3 * BS)
    store.save(other, [20, 21, 22])  # the 3 other slots: full now
    with pytest.raises(TierFullError):  # needs 4 slots; only 3 could ever be evicted
        store.save(prompt(rng, 4 * BS), [30, 31, 32, 33])
    assert store.dram.used == 6
    assert hits(store, other) == (3, ("dram",) * 3)
    assert counters(store).get("evictions", 0) == 0
    assert kv.held() == [[]] * N_POOLS
    store.release(hit)


def test_more_blocks_than_dram_slots(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 3), kv.pools)
    with pytest.raises(TierFullError, match=r"do not fit in its 3 slots"):
        store.save(prompt(rng, 4 * BS), [0, 1, 2, 3])
    assert store.dram.used == 0 and kv.held() == [[]] * N_POOLS


def _threads_inside(function: str) -> int:
    """How many threads have ``function`` on their stack now."""
    count = 0
    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == function:
                count += 1
                break
            frame = frame.f_back
    return count


def test_concurrent_loads_of_one_handle(arrays, rng, stores, tmp_path):
    """Two loads of one handle at once: exactly one loads; the other raises StaleHandleError
    and, like every rejected call, writes nothing. (White box: the first load is held at DRAM's
    room lock, where promotion from disk waits, while the second one is refused.)"""
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 8, disk=16), kv.pools)
    tokens = prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    store.save(prompt(rng, 8 * BS), list(range(4, 12)))  # tokens' blocks now on disk only
    assert store.flush(TIMEOUT)
    hit = store.lookup(tokens)
    assert hit.tiers == ("disk",) * 4
    before = kv.snapshot()
    targets = ([20, 21, 22, 23], [30, 31, 32, 33])
    stuck = store._stack._room_locks[0]
    stuck.acquire()
    try:
        futures = [store.load_async(hit, ids) for ids in targets]
        deadline = time.monotonic() + TIMEOUT
        while (
            _threads_inside("promote") < 1 or not any(f.done() for f in futures)
        ) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert _threads_inside("promote") == 1  # the winner, stuck at the room lock
        assert sum(f.done() for f in futures) == 1  # the loser, refused while it is stuck
    finally:
        stuck.release()
    concurrent.futures.wait(futures, TIMEOUT)
    outcomes = [f.exception() is None for f in futures]
    assert sorted(outcomes) == [False, True]
    winner = outcomes.index(True)
    assert isinstance(futures[1 - winner].exception(), StaleHandleError)
    kv.check(targets[winner], expected, before, written=targets[1 - winner])
    loser = [b[targets[1 - winner]] for b in kv.snapshot()]
    assert same(loser, [b[targets[1 - winner]] for b in before]), (
        "a load that raised StaleHandleError wrote its device blocks"
    )


# --- LRU, demotion, promotion -------------------------------------------------------------------


def test_lru_evicts_the_least_recently_used(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 4), kv.pools)
    prompts = [prompt(rng, BS) for _ in range(7)]
    blocks = [kv.blocks([i]) for i in range(7)]

    def cached() -> list[bool]:
        return [store.dram.contains(keys_of(store, p))[0] for p in prompts]

    for i in range(4):
        store.save(prompts[i], [i])
    hit = store.lookup(prompts[0])  # a lookup alone does not touch; the load does
    store.load(hit, [40])
    store.save(prompts[4], [4])  # evicts 1, the least recently used
    assert cached() == [True, False, True, True, True, False, False]
    assert store.save(prompts[2], [2]).skipped_blocks == 1  # a re-save touches 2
    store.save(prompts[5], [5])  # evicts 3
    assert cached() == [True, False, True, False, True, True, False]
    store.save(prompts[6], [6])  # evicts 0
    assert cached() == [False, False, True, False, True, True, True]
    stats = store.stats()
    assert stats["store"]["evictions"] == 3
    assert stats["tiers"]["dram"]["evictions"] == 3
    for i in (2, 4, 5, 6):
        before = kv.snapshot()
        assert store.load(store.lookup(prompts[i]), [50 + i]).loaded_blocks == 1
        kv.check([50 + i], blocks[i], before)


def test_lru_matches_a_model(arrays, rng, stores):
    """Random saves and loads of one-block prompts against an OrderedDict LRU (DRAM only)."""
    kv = Kv(arrays, rng)
    prompts = [prompt(rng, BS) for _ in range(8)]
    contents = [kv.blocks([i]) for i in range(8)]

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        capacity=st.integers(2, 5),
        ops=st.lists(st.tuples(st.sampled_from(["save", "load"]), st.integers(0, 7)), max_size=25),
    )
    def run(capacity, ops):
        with KVCacheStore(make_config(None, capacity), kv.pools) as store:
            model: OrderedDict[int, None] = OrderedDict()
            for op, i in ops:
                if op == "save":
                    result = store.save(prompts[i], [i])
                    assert result.skipped_blocks == (i in model)
                    if i not in model and len(model) == capacity:
                        model.popitem(last=False)
                    model[i] = None
                    model.move_to_end(i)
                else:
                    hit = store.lookup(prompts[i])
                    assert hit.num_blocks == (i in model)
                    result = store.load(hit, [20 + i][: hit.num_blocks])
                    assert result.loaded_blocks == (i in model)
                    if i in model:
                        model.move_to_end(i)
                        kv.check([20 + i], contents[i])
                cached = [store.dram.contains(keys_of(store, p))[0] for p in prompts]
                assert cached == [i in model for i in range(8)], (op, i, list(model))

    run()


def test_demotion_and_promotion_with_a_disk_tier(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=16), kv.pools)
    disk = store._stack.tiers[1]
    prompts = [prompt(rng, 2 * BS) for _ in range(6)]
    contents = [kv.blocks([2 * i, 2 * i + 1]) for i in range(6)]
    for i in range(2):
        store.save(prompts[i], [2 * i, 2 * i + 1])
    assert store.flush(TIMEOUT)  # written through: both on disk already
    assert all(disk.contains(keys_of(store, p)) == [True, True] for p in prompts[:2])
    for i in (2, 3):  # evict 0 and 1 from DRAM
        store.save(prompts[i], [2 * i, 2 * i + 1])
    assert store.flush(TIMEOUT)
    assert counters(store)["evictions"] == 4
    assert counters(store).get("demotions", 0) == 0  # nothing to write: disk had them
    assert hits(store, prompts[0]) == (2, ("disk", "disk"))

    # blocks only in DRAM (white box: their disk copies deleted) are demoted when evicted
    for i in (2, 3):
        assert disk.delete(keys_of(store, prompts[i])) == 2
    for i in (4, 5):
        store.save(prompts[i], [2 * i, 2 * i + 1])
    assert store.flush(TIMEOUT)
    stats = counters(store)
    assert stats["demotions"] == 4
    assert stats["evictions"] == 8
    assert store.stats()["tiers"]["dram"]["evictions"] >= 4
    for i in range(4):
        assert hits(store, prompts[i]) == (2, ("disk", "disk")), i

    before = kv.snapshot()
    hit = store.lookup(prompts[2])
    result = store.load(hit, [40, 41])
    assert (result.loaded_blocks, result.promoted_blocks) == (2, 2)
    kv.check([40, 41], contents[2], before)
    assert hits(store, prompts[2]) == (2, ("dram", "dram"))  # promoted, and stays
    assert counters(store)["promotions"] == 2
    assert store.stats()["tiers"]["disk"]["hits"] == 2


def test_dram_evictions_are_counted_with_a_lower_tier(arrays, rng, stores, tmp_path):
    """tiers['dram']['evictions'] counts every block DRAM evicts, whether it had to be
    demoted first or the disk already held it (as it does without a lower tier)."""
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=16), kv.pools)
    store.save(prompt(rng, 4 * BS), [0, 1, 2, 3])
    assert store.flush(TIMEOUT)  # on disk too: evicting needs no demotion
    store.save(prompt(rng, 4 * BS), [4, 5, 6, 7])
    stats = store.stats()
    assert stats["store"]["evictions"] == 4
    assert stats["tiers"]["dram"]["evictions"] == 4


# --- save futures, held blocks, async forms ------------------------------------------------------


def test_save_future_and_skips(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 5 * BS)
    future = store.save_async(tokens[: 3 * BS], [0, 1, 2])
    assert isinstance(future, SaveFuture)
    assert future.released.result(TIMEOUT) is None
    result = future.result(TIMEOUT)
    assert (result.stored_blocks, result.skipped_blocks) == (3, 0)
    assert result.bytes == 3 * store.layout.payload_bytes and result.seconds >= 0
    again = store.save(tokens[: 3 * BS], [0, 1, 2])
    assert (again.stored_blocks, again.skipped_blocks, again.bytes) == (0, 3, 0)
    more = store.save(tokens, [0, 1, 2, 3, 4, 5, 6])  # extra ids past the full blocks: ignored
    assert (more.stored_blocks, more.skipped_blocks) == (2, 3)
    stats = counters(store)
    assert (stats["saves"], stats["saved_blocks"], stats["save_skipped_blocks"]) == (3, 5, 6)
    empty = store.save(tokens[: BS - 1], [])  # no full block: nothing to save
    assert (empty.stored_blocks, empty.skipped_blocks, empty.bytes) == (0, 0, 0)


def test_a_save_of_stored_blocks_is_done_at_once_on_the_callers_thread(arrays, rng, stores):
    """Every block already stored (an engine saving what its own prefix cache served): the
    future is done when the call returns, no worker thread ran, and the blocks are the most
    recently used (a later eviction takes the others first)."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 4), kv.pools)
    first, second = prompt(rng, 2 * BS), prompt(rng, 2 * BS)
    store.save(first, [0, 1])
    store.save(second, [2, 3])
    calls = store._calls.submit
    store._calls.submit = None  # type: ignore[method-assign]  # any hop to a worker fails
    try:
        again = store.save_async(first, [0, 1])
        assert again.done() and again.released.done()
    finally:
        store._calls.submit = calls  # type: ignore[method-assign]
    assert (again.result().stored_blocks, again.result().skipped_blocks) == (0, 2)
    store.save(prompt(rng, 2 * BS), [4, 5])  # DRAM holds 4: the two least recent go
    with store.lookup(first) as kept, store.lookup(second) as evicted:
        assert (kept.num_blocks, evicted.num_blocks) == (2, 0)


def test_device_blocks_are_held_while_a_save_runs(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 3 * BS)
    expected = kv.blocks([4, 5, 6])
    stuck = store._stack._room_locks[0]  # white box: the save waits for DRAM room
    stuck.acquire()
    try:
        future = store.save_async(tokens, [4, 5, 6])
        assert kv.held() == [[4, 5, 6]] * N_POOLS
        assert not future.released.done()
        src = arrays.random(rng, (2, BS, HEADS, DIM), BF16)
        with pytest.raises(BlocksHeldError, match=r"blocks \[5\]"):
            tpusync.transfer(src, kv.pools[1], dst_blocks=[9, 5]).result(TIMEOUT)
        tpusync.transfer(src, kv.pools[1], dst_blocks=[9, 10]).result(TIMEOUT)  # not held: fine
        other = store.lookup(tokens)  # nothing cached yet
        assert other.num_blocks == 0
        store.release(other)
        assert same(kv.blocks([4, 5, 6]), expected)
    finally:
        stuck.release()
    assert future.released.result(TIMEOUT) is None
    assert future.result(TIMEOUT).stored_blocks == 3
    assert kv.held() == [[]] * N_POOLS
    src = arrays.random(rng, (2, BS, HEADS, DIM), BF16)
    tpusync.transfer(src, kv.pools[1], dst_blocks=[9, 5]).result(TIMEOUT)  # accepted now
    before = kv.snapshot()
    store.load(store.lookup(tokens), [20, 21, 22])
    kv.check([20, 21, 22], expected, before)


def test_load_into_blocks_a_save_holds(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    a, b = prompt(rng, 2 * BS), prompt(rng, 2 * BS)
    store.save(a, [0, 1])
    hit = store.lookup(a)
    stuck = store._stack._room_locks[0]  # white box: keeps the save of b in flight
    stuck.acquire()
    try:
        future = store.save_async(b, [7, 8])
        before = kv.snapshot()
        with pytest.raises(BlocksHeldError, match=r"^device_block_ids: blocks \[8\]"):
            store.load(hit, [8, 9])
        assert hit.open and same(kv.snapshot(), before)
    finally:
        stuck.release()
    future.result(TIMEOUT)
    assert store.load(hit, [8, 9]).loaded_blocks == 2


def test_async_forms(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 16, disk=16), kv.pools)
    tokens = prompt(rng, 3 * BS + 3)
    expected = kv.blocks([0, 1, 2, 3])
    assert store.save_async(tokens, [0, 1, 2]).result(TIMEOUT).stored_blocks == 3
    lookup = store.lookup_async(tokens)
    assert isinstance(lookup, concurrent.futures.Future)
    hit = lookup.result(TIMEOUT)
    assert hit.num_blocks == 3 and hit.open
    before = kv.snapshot()
    loaded = store.load_async(hit, [20, 21, 22]).result(TIMEOUT)
    assert loaded.loaded_tokens == 3 * BS
    kv.check([20, 21, 22], [e[:3] for e in expected], before)
    store.offload_session_async("s", tokens, [0, 1, 2, 3]).result(TIMEOUT)
    before = kv.snapshot()
    restored = store.restore_session_async("s", [30, 31, 32, 33]).result(TIMEOUT)
    assert isinstance(restored, SessionRestore)
    assert restored.loaded_tokens == len(tokens)
    kv.check([30, 31, 32, 33], expected, before)
    with pytest.raises(InvalidArgumentError, match=r"^tokens: "):
        store.lookup_async([0.5])
    assert store.prefetch(tokens).result(TIMEOUT) == 3


def test_asyncio(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 2 * BS)
    expected = kv.blocks([5, 6])

    async def main() -> tuple[SaveResult, LoadResult]:
        saved = await store.save_async(tokens, [5, 6])
        hit = await asyncio.wrap_future(store.lookup_async(tokens))
        loaded = await asyncio.wrap_future(store.load_async(hit, [10, 11]))
        return saved, loaded

    before = kv.snapshot()
    saved, loaded = asyncio.run(main())
    assert saved.stored_blocks == 2 and loaded.loaded_blocks == 2
    kv.check([10, 11], expected, before)


# --- write-back ----------------------------------------------------------------------------------


def test_flush_writes_every_block_to_every_lower_tier(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 32, disk=32, shared=True), kv.pools)
    prompts = [prompt(rng, 4 * BS) for _ in range(5)]
    futures = [
        store.save_async(p, [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3]) for i, p in enumerate(prompts)
    ]
    for future in futures:
        future.result(TIMEOUT)
    assert store.flush(TIMEOUT)
    keys = [k for p in prompts for k in keys_of(store, p)]
    for tier in store._stack.tiers:
        assert tier.contains(keys) == [True] * 20
    stats = store.stats()
    assert stats["store"]["writeback_written"] == 40
    assert stats["store"]["writeback_pending_bytes"] == 0
    assert stats["tiers"]["disk"]["used"] == stats["tiers"]["shared_fs"]["used"] == 20


def test_writeback_skip_policy_never_loses_a_block(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    payload = 2048  # bytes per block of this layout
    store = stores(
        make_config(tmp_path, 8, disk=32, writeback_policy="skip", writeback_max_bytes=payload),
        kv.pools,
    )
    assert store.layout.payload_bytes == payload
    disk = store._stack.tiers[1]
    prompts = [prompt(rng, 2 * BS) for _ in range(8)]
    contents = [kv.blocks([2 * i, 2 * i + 1]) for i in range(8)]
    stuck = store._stack._room_locks[1]  # white box: the write-back of the first save waits
    stuck.acquire()
    try:
        for i in range(3):
            store.save(prompts[i], [2 * i, 2 * i + 1])
        assert counters(store)["writeback_skipped"] == 4  # saves 1 and 2 found the queue full
        assert 0 < counters(store)["writeback_pending_bytes"] <= 2 * payload
    finally:
        stuck.release()
    assert store.flush(TIMEOUT)
    assert disk.contains(keys_of(store, prompts[0])) == [True, True]
    for i in (1, 2):  # skipped: in DRAM only
        assert disk.contains(keys_of(store, prompts[i])) == [False, False]
    for i in range(3, 8):  # evict everything saved so far
        store.save(prompts[i], [2 * i, 2 * i + 1])
    assert store.flush(TIMEOUT)
    assert counters(store)["demotions"] >= 4
    for i in range(8):  # every block is somewhere, and loads bit for bit
        hit = store.lookup(prompts[i])
        assert hit.num_blocks == 2, (i, hit.tiers)
        before = kv.snapshot()
        assert store.load(hit, [50, 51]).loaded_blocks == 2
        kv.check([50, 51], contents[i], before)


def test_writeback_wait_policy_bounds_the_queue(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    payload = 2048
    bound = 2 * payload
    store = stores(
        make_config(tmp_path, 48, disk=48, writeback_policy="wait", writeback_max_bytes=bound),
        kv.pools,
    )
    one_save = 3 * payload
    samples: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append(store.stats()["store"]["writeback_pending_bytes"])
            time.sleep(0.0005)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stuck = store._stack._room_locks[1]  # white box: hold the write-back to force waiting
    try:
        stuck.acquire()
        try:
            first = store.save_async(prompt(rng, 3 * BS), [0, 1, 2])
            first.result(TIMEOUT)
            second = store.save_async(prompt(rng, 3 * BS), [3, 4, 5])
            # the queue is full: the second save waits, its device blocks stay held
            done, _ = concurrent.futures.wait([second.released], timeout=0.3)
            assert not done
            assert not second.done()
            assert kv.held() == [[3, 4, 5]] * N_POOLS
        finally:
            stuck.release()
        second.result(TIMEOUT)
        futures = [
            store.save_async(prompt(rng, 3 * BS), [6 + 3 * i, 7 + 3 * i, 8 + 3 * i])
            for i in range(12)
        ]
        for future in futures:
            future.result(TIMEOUT)
        assert store.flush(TIMEOUT)
    finally:
        stop.set()
        sampler.join(TIMEOUT)
    assert samples and max(samples) <= max(bound, one_save)
    assert counters(store)["writeback_waits"] >= 1
    assert counters(store)["writeback_written"] == 42
    assert counters(store)["writeback_pending_bytes"] == 0


# --- purge, namespaces ---------------------------------------------------------------------------


def test_purge_drops_only_its_namespace(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 16, disk=16, shared=True), kv.pools)
    v1 = dataclasses.replace(store.namespace, weight_version="1")
    salted = dataclasses.replace(store.namespace, salt=b"tenant-b")
    tokens = prompt(rng, 3 * BS)
    for ns in (None, v1, salted):
        store.save(tokens, [0, 1, 2], namespace=ns)
    assert store.dram.used == 9  # the same tokens under three namespaces: nine blocks
    store.offload_session_async("mine", [*tokens, 1, 2], [0, 1, 2, 3]).result(TIMEOUT)
    store.offload_session_async("theirs", [*tokens, 1, 2], [0, 1, 2, 3], namespace=v1).result(
        TIMEOUT
    )
    assert store.flush(TIMEOUT)
    dropped = store.purge()
    assert dropped == 3 * 4  # 3 full blocks and a tail, in each of the 3 tiers
    assert hits(store, tokens) == (0, ())
    assert hits(store, tokens, v1) == (3, ("dram",) * 3)
    assert hits(store, tokens, salted) == (3, ("dram",) * 3)
    assert store.sessions() == ["theirs"]
    own = set(keys_of(store, tokens))
    for tier in store._stack.tiers:
        assert not own & set(tier.keys())
    assert store.purge(v1) == 3 * 4
    assert hits(store, tokens, v1) == (0, ())
    assert store.sessions() == []
    assert hits(store, tokens, salted)[0] == 3
    assert store.purge() == 0


def test_purge_keeps_pinned_blocks_until_unpinned(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 2 * BS)
    expected = kv.blocks([0, 1])
    store.save(tokens, [0, 1])
    hit = store.lookup(tokens)
    assert store.purge() == 0  # both pinned: dropped at the last unpin
    before = kv.snapshot()
    assert store.load(hit, [20, 21]).loaded_blocks == 2
    kv.check([20, 21], expected, before)
    assert store.dram.used == 0
    assert hits(store, tokens) == (0, ())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model_id", "another-model"),
        ("layout_fingerprint", b"\x00" * 16),
        ("shard_rank", 1),
        ("shard_count", 2),
    ],
)
def test_namespace_mismatch(arrays, rng, stores, field, value):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 2 * BS)
    store.save(tokens, [0, 1])
    fields = {field: value}
    if field == "shard_rank":
        fields["shard_count"] = 2
    ns = dataclasses.replace(store.namespace, **fields)
    calls = {
        "save": lambda: store.save(tokens, [0, 1], namespace=ns),
        "save_async": lambda: store.save_async(tokens, [0, 1], namespace=ns),
        "lookup": lambda: store.lookup(tokens, namespace=ns),
        "lookup_async": lambda: store.lookup_async(tokens, namespace=ns),
        "prefetch": lambda: store.prefetch(tokens, namespace=ns),
        "purge": lambda: store.purge(ns),
        "offload_session": lambda: store.offload_session_async("s", tokens, [0, 1], namespace=ns),
    }
    for name, call in calls.items():
        with pytest.raises(NamespaceMismatchError, match=rf"^namespace: its {field}") as info:
            call()
        assert isinstance(info.value, InvalidArgumentError), name
    with pytest.raises(InvalidArgumentError, match=r"^namespace: expected a tpusync.kv.Namespace"):
        store.lookup(tokens, namespace="v1")  # type: ignore[arg-type]
    assert store.dram.used == 2 and store.sessions() == []
    assert counters(store)["open_handles"] == 0 and kv.held() == [[]] * N_POOLS


# --- prefetch ------------------------------------------------------------------------------------


def test_prefetch_moves_blocks_up_into_dram(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=16), kv.pools)
    a, b = prompt(rng, 4 * BS), prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(a, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    store.save(b, [4, 5, 6, 7])  # a now rests on disk only
    assert hits(store, a) == (4, ("disk",) * 4)
    future = store.prefetch(a + prompt(rng, 20))
    assert isinstance(future, concurrent.futures.Future)
    assert future.result(TIMEOUT) == 4
    assert hits(store, a) == (4, ("dram",) * 4)
    assert counters(store)["prefetched_blocks"] == 4
    assert counters(store)["promotions"] == 4
    assert store.prefetch(a).result(TIMEOUT) == 4  # already there
    assert store.prefetch(prompt(rng, 3 * BS)).result(TIMEOUT) == 0  # never saved
    before = kv.snapshot()
    result = store.load(store.lookup(a), [20, 21, 22, 23])
    assert (result.loaded_blocks, result.promoted_blocks) == (4, 0)
    kv.check([20, 21, 22, 23], expected, before)


# --- sessions ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [5, 0], ids=["partial", "whole"])
def test_offload_and_restore_a_session(arrays, rng, stores, tail):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 4 * BS + tail)
    n = 4 + (tail > 0)
    src = [9, 3, 17, 30, 31][:n]
    expected = kv.blocks(src)
    future = store.offload_session_async("agent-1", tokens, src)
    assert isinstance(future, SaveFuture)
    assert future.result(TIMEOUT).stored_blocks == n  # the partial block too
    assert store.sessions() == ["agent-1"]
    assert counters(store)["sessions"] == 1
    kv.write(src)  # the engine reuses the freed device blocks
    before = kv.snapshot()
    dst = [40, 41, 42, 43, 44][:n]
    restored = store.restore_session("agent-1", dst)
    assert restored.session_id == "agent-1"
    assert restored.tokens.tolist() == tokens
    assert restored.loaded_tokens == len(tokens)
    assert restored.bytes == n * store.layout.payload_bytes
    kv.check(dst, expected, before)
    assert store.sessions() == []
    with pytest.raises(SessionNotFoundError, match=r"agent-1") as info:
        store.restore_session("agent-1", dst)
    assert isinstance(info.value, KeyError)
    assert store.dram.used == 4  # the tail block went with the session; full blocks stay
    assert hits(store, tokens) == (4, ("dram",) * 4)


def test_drop_session(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 2 * BS + 3)
    store.offload_session_async("s", tokens, [0, 1, 2])
    store.drop_session("s")
    assert store.sessions() == []
    with pytest.raises(SessionNotFoundError):
        store.restore_session("s", [10, 11, 12])
    with pytest.raises(SessionNotFoundError):
        store.drop_session("s")
    assert store.dram.used == 2
    assert hits(store, tokens) == (2, ("dram", "dram"))
    # the full blocks are ordinary cache blocks now: 16 new blocks evict them
    store.save(prompt(rng, 16 * BS), list(range(20, 36)))
    assert hits(store, tokens) == (0, ())


def test_offload_again_replaces_the_session(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 2 * BS + 3)
    store.offload_session_async("s", tokens, [0, 1, 2]).result(TIMEOUT)
    longer = tokens + prompt(rng, BS)  # the session went on: 3 full blocks and a tail of 3
    expected = kv.blocks([0, 1, 5, 6])
    store.offload_session_async("s", longer, [0, 1, 5, 6]).result(TIMEOUT)
    assert store.sessions() == ["s"]
    assert store.dram.used == 4 + 0  # 2 shared full blocks, a new full block, a new tail
    before = kv.snapshot()
    restored = store.restore_session("s", [10, 11, 12, 13])
    assert restored.tokens.tolist() == longer and restored.loaded_tokens == len(longer)
    kv.check([10, 11, 12, 13], expected, before)


def test_session_blocks_survive_lru_pressure(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 3 * BS + 9)
    expected = kv.blocks([0, 1, 2, 3])
    store.offload_session_async("s", tokens, [0, 1, 2, 3]).result(TIMEOUT)
    for i in range(6):  # cycles the 4 other slots
        store.save(prompt(rng, 4 * BS), [10 + i, 20, 21, 22])
    with pytest.raises(TierFullError):  # would need a session's slot
        store.save(prompt(rng, 5 * BS), [30, 31, 32, 33, 34])
    assert store.sessions() == ["s"]
    before = kv.snapshot()
    restored = store.restore_session("s", [40, 41, 42, 43])
    assert restored.loaded_tokens == len(tokens)
    kv.check([40, 41, 42, 43], expected, before)
    assert store.save(prompt(rng, 5 * BS), [30, 31, 32, 33, 34]).stored_blocks == 5


def test_sessions_survive_reopen_with_named_dram(arrays, rng, stores, shm_names):
    kv = Kv(arrays, rng)
    config = make_config(None, 8, name=shm_names())
    tokens = prompt(rng, 2 * BS + 11)
    expected = kv.blocks([5, 6, 7])
    store = stores(config, kv.pools)
    store.offload_session_async("named", tokens, [5, 6, 7]).result(TIMEOUT)
    store.close()
    assert pool_path(config.dram.name).exists()
    kv.write([5, 6, 7])

    again = stores(config, kv.pools)
    assert again.dram.attached
    assert again.sessions() == ["named"]
    before = kv.snapshot()
    restored = again.restore_session("named", [50, 51, 52])
    assert restored.tokens.tolist() == tokens and restored.loaded_tokens == len(tokens)
    kv.check([50, 51, 52], expected, before)
    assert again.sessions() == []
    again.close()
    third = stores(config, kv.pools)  # restored means gone, across restarts too
    assert third.sessions() == []
    assert hits(third, tokens) == (2, ("dram", "dram"))


def test_sessions_survive_reopen_with_a_disk_tier(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    config = make_config(tmp_path, 8, disk=16)
    tokens = prompt(rng, 3 * BS + 1)
    expected = kv.blocks([1, 3, 5, 7])
    store = stores(config, kv.pools)
    store.offload_session_async("on-disk", tokens, [1, 3, 5, 7])  # close() waits for it
    store.close()
    kv.write([1, 3, 5, 7])

    again = stores(config, kv.pools)
    assert again.sessions() == ["on-disk"]
    assert again.dram.used == 0  # anonymous DRAM starts empty: every block comes from disk
    before = kv.snapshot()
    restored = again.restore_session("on-disk", [60, 61, 62, 63])
    assert restored.loaded_tokens == len(tokens)
    kv.check([60, 61, 62, 63], expected, before)
    with pytest.raises(SessionNotFoundError):
        again.restore_session("on-disk", [60, 61, 62, 63])


def test_session_blocks_with_a_disk_tier_under_pressure(arrays, rng, stores, tmp_path):
    """DRAM may demote a session's blocks; the disk, the lowest tier, never drops them."""
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=6), kv.pools)
    tokens = prompt(rng, 2 * BS + 5)
    expected = kv.blocks([0, 1, 2])
    store.offload_session_async("s", tokens, [0, 1, 2]).result(TIMEOUT)
    for i in range(8):  # 16 blocks through 4 DRAM slots and the 3 other disk slots
        store.save(prompt(rng, 2 * BS), [10 + 2 * i, 11 + 2 * i])
        assert store.flush(TIMEOUT)
    full = keys_of(store, tokens)
    session_keys = [*full, store.scheme.tail_key(store.namespace, full[-1], "s", tokens[2 * BS :])]
    assert store._stack.tiers[1].contains(session_keys) == [True] * 3  # kept on disk
    assert store.dram.contains(session_keys) == [False] * 3  # demoted out of DRAM
    assert store._stack.tiers[1].used == 6
    assert store.sessions() == ["s"]
    before = kv.snapshot()
    restored = store.restore_session("s", [40, 41, 42])
    assert restored.loaded_tokens == len(tokens)
    kv.check([40, 41, 42], expected, before)


def test_a_store_that_fails_to_open_closes_its_tiers(arrays, rng, stores, tmp_path, shm_names):
    kv = Kv(arrays, rng)
    name = shm_names()
    stores(make_config(tmp_path, 4, disk=8), kv.pools)  # owns tmp_path/disk
    with pytest.raises(PoolBusyError):
        KVCacheStore(make_config(tmp_path, 4, disk=8, name=name), kv.pools)
    # the named DRAM pool it had opened first was closed again: another store may own it
    other = stores(make_config(tmp_path / "other", 4, disk=8, name=name), kv.pools)
    assert other.dram.name == name
    with pytest.raises(PoolBusyError):  # one owner at a time
        KVCacheStore(make_config(None, 4, name=name), kv.pools)


def test_bad_tier_options_are_rejected_by_the_config(tmp_path):
    """Tier options are checked when the config is built, naming the tier's field."""
    cases = [
        (lambda: DiskTier(tmp_path / "d", 4, durability="x"), "disk.durability"),
        (lambda: DiskTier(tmp_path / "d", 4, direct_io="x"), "disk.direct_io"),
        (lambda: DiskTier(tmp_path / "d", 4, direct_io=1), "disk.direct_io"),
        (lambda: SharedFsTier(tmp_path, durability="x"), "shared_fs.durability"),
        (lambda: DramTier(4, name="bad/name"), "dram.name"),
    ]
    for build, argument in cases:
        with pytest.raises(InvalidArgumentError, match=rf"^{re.escape(argument)}: "):
            build()


@pytest.mark.parametrize("bad", ["", 7, None, "x" * 257, b"s"], ids=repr)
def test_bad_session_ids(arrays, rng, stores, bad):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    for call in (
        lambda: store.offload_session_async(bad, prompt(rng, BS), [0]),
        lambda: store.restore_session(bad, [0]),
        lambda: store.drop_session(bad),
    ):
        with pytest.raises(InvalidArgumentError, match=r"^session_id: "):
            call()
    assert store.sessions() == [] and store.dram.used == 0


def test_session_with_no_tokens(arrays, rng, stores):
    """An empty session is accepted (no blocks), and can be offloaded again and restored."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    store.offload_session_async("empty", [], []).result(TIMEOUT)
    assert store.sessions() == ["empty"]
    tokens = prompt(rng, BS + 2)
    store.offload_session_async("empty", tokens, [0, 1]).result(TIMEOUT)
    assert store.restore_session("empty", [5, 6]).loaded_tokens == len(tokens)


# --- corruption ----------------------------------------------------------------------------------


def test_corrupt_dram_block_is_a_miss(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    slot = store.dram.slot_of(keys_of(store, tokens)[2])
    with store.dram.slot_memory(slot) as memory:
        memory[777] ^= 0x5A
    hit = store.lookup(tokens)
    assert hit.num_blocks == 4  # the lookup does not read payloads
    before = kv.snapshot()
    result = store.load(hit, [20, 21, 22, 23])
    assert (result.loaded_tokens, result.loaded_blocks, result.requested_blocks) == (32, 2, 4)
    kv.check([20, 21], [e[:2] for e in expected], before, written=[22, 23])
    stats = store.stats()
    assert stats["tiers"]["dram"]["checksum_failures"] == 1
    assert stats["store"]["load_misses"] == 2
    assert hits(store, tokens) == (2, ("dram", "dram"))
    assert store.dram.used == 3


def _disk_offset(disk: Any, key: bytes) -> tuple[Path, int]:
    """The slab file and byte offset of a block on disk, from the DiskPool format
    (slot s lives in slab s // slab_slots at 4096 + (s % slab_slots) * slot_bytes)."""
    slot = disk._index[key]
    slab, within = divmod(slot, disk.slab_slots)
    return (
        disk.directory / f"slab-{slab:06d}.tpd",
        DISK_HEADER_BYTES + within * disk.layout.slot_bytes,
    )


def test_corrupt_disk_block_is_a_miss(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, disk=16), kv.pools)
    tokens = prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    store.save(prompt(rng, 4 * BS), [4, 5, 6, 7])  # tokens' blocks now on disk only
    assert store.flush(TIMEOUT)
    disk = store._stack.tiers[1]
    path, offset = _disk_offset(disk, keys_of(store, tokens)[1])
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, rng.integers(0, 256, 64, dtype=np.uint8).tobytes(), offset + 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    assert hits(store, tokens) == (4, ("disk",) * 4)
    before = kv.snapshot()
    result = store.load(store.lookup(tokens), [20, 21, 22, 23])
    assert (result.loaded_tokens, result.loaded_blocks) == (BS, 1)
    kv.check([20], [e[:1] for e in expected], before)
    stats = store.stats()
    assert stats["tiers"]["disk"]["checksum_failures"] == 1
    assert stats["store"]["lower_tier_misses"] == 1
    assert hits(store, tokens)[0] == 1
    assert not disk.contains([keys_of(store, tokens)[1]])[0]


def test_corrupt_shared_fs_block_is_a_miss(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 4, shared=True), kv.pools)
    tokens = prompt(rng, 4 * BS)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    store.save(prompt(rng, 4 * BS), [4, 5, 6, 7])
    assert store.flush(TIMEOUT)
    shared = store._stack.tiers[1]
    key = keys_of(store, tokens)[3]
    path = shared.path_of(key)
    with open(path, "r+b") as handle:
        handle.seek(SHARED_HEADER_BYTES + 5)
        byte = handle.read(1)
        handle.seek(SHARED_HEADER_BYTES + 5)
        handle.write(bytes([byte[0] ^ 0xFF]))
    assert hits(store, tokens) == (4, ("shared_fs",) * 4)
    before = kv.snapshot()
    result = store.load(store.lookup(tokens), [20, 21, 22, 23])
    assert (result.loaded_tokens, result.loaded_blocks) == (3 * BS, 3)
    kv.check([20, 21, 22], [e[:3] for e in expected], before)
    assert store.stats()["tiers"]["shared_fs"]["checksum_failures"] == 1
    assert hits(store, tokens)[0] == 3
    assert not os.path.exists(path)


# --- bad input -----------------------------------------------------------------------------------


def _state(store: KVCacheStore, kv: Kv) -> tuple[Any, ...]:
    stats = store.stats()
    return (
        sorted(store.dram.keys()),
        store.sessions(),
        stats["store"]["open_handles"],
        stats["store"]["saves"],
        kv.held(),
        kv.snapshot(),
    )


def _same_state(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return a[:-1] == b[:-1] and same(a[-1], b[-1])


def test_bad_calls_change_nothing(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens = prompt(rng, 3 * BS)
    store.save(tokens, [0, 1, 2])
    store.offload_session_async("s", tokens, [0, 1, 2]).result(TIMEOUT)
    hit = store.lookup(tokens)
    new = prompt(rng, 3 * BS)
    save, load = store.save, store.load
    bad_calls: dict[tuple[str, type[Exception]], list[Callable[[], Any]]] = {
        ("tokens", InvalidArgumentError): [
            lambda: save([1.5] * BS, [0]),
            lambda: store.lookup("hello"),
            lambda: store.lookup(None),
            lambda: store.lookup([True] * BS),
            lambda: store.prefetch([-1] * BS),
            lambda: store.offload_session_async("t", [2**32] * BS, [0]),
            lambda: store.save_async(np.ones((2, BS), int), [0, 1]),
        ],
        ("device_block_ids", BlockIndexError): [
            lambda: save(new, [5, 6, NB]),
            lambda: save(new, [5, -6, 7]),
            lambda: save(new, [5, 6, 5]),
            lambda: load(hit, [5, 6, 99]),
            lambda: load(hit, [5, 5, 6]),
            lambda: store.restore_session("s", [5, 6, 64]),
        ],
        ("device_block_ids", InvalidArgumentError): [
            lambda: save(new, [5, 6]),  # too few
            lambda: save(new, [5.0, 6.0, 7.0]),
            lambda: save(new, [True, False, True]),
            lambda: save(new, [[5, 6, 7]]),
            lambda: save(new, None),
            lambda: save(new, "567"),
            lambda: save(new, [5, [6], 7]),
            lambda: load(hit, [5, 6, 7, 8]),  # too many
            lambda: load(hit, np.array([5.0, 6.0, 7.0])),
            lambda: store.restore_session("s", [5, 6]),
            lambda: store.offload_session_async("t", [*new, 1], [5, 6, 7]),  # 4 blocks
        ],
        ("session_id", SessionNotFoundError): [lambda: store.restore_session("nope", [5, 6, 7])],
        ("namespace", InvalidArgumentError): [lambda: store.purge("ns")],  # type: ignore[arg-type]
    }
    before = _state(store, kv)
    for (argument, error), calls in bad_calls.items():
        for i, call in enumerate(calls):
            with pytest.raises(error, match=rf"^{argument}: ") as info:
                call()
            assert isinstance(info.value, TpuSyncError), (argument, i)
            assert _same_state(_state(store, kv), before), (argument, i)
    assert hit.open
    assert hits(store, new) == (0, ())
    assert store.load(hit, [5, 6, 7]).loaded_blocks == 3


def test_bad_device_pools(arrays, rng):
    kv = Kv(arrays, rng)
    small = Kv(arrays, rng, blocks=32)
    config = make_config(None, 4)
    cases = [
        (kv.pools[0], "device_pools: expected a list"),
        ([], "device_pools: the list is empty"),
        ([*kv.pools[:2], small.pools[0]], r"device_pools: every pool needs the same number"),
        ([kv.pools[0], kv.pools[1].array], r"device_pools\[1\]: expected a DevicePool"),
        ([np.zeros((NB, BS, HEADS, DIM))], r"device_pools\[0\]: expected a DevicePool"),
        (iter(kv.pools), "device_pools: expected a list"),
        ("pools", r"device_pools\[0\]: expected a DevicePool|device_pools: expected a list"),
    ]
    for pools, message in cases:
        with pytest.raises(InvalidArgumentError, match=rf"^{message}"):
            KVCacheStore(config, pools)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"^device_pools: .*block_axis=4"):
        KVCacheStore(dataclasses.replace(config, block_axis=4), kv.pools)
    with pytest.raises(InvalidArgumentError, match=r"^config: expected a KVStoreConfig"):
        KVCacheStore({"model_id": "m"}, kv.pools)  # type: ignore[arg-type]


def test_bad_config(tmp_path):
    dram = DramTier(4)
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: KVStoreConfig("m", 0, dram), "block_size"),
        (lambda: KVStoreConfig("m", -16, dram), "block_size"),
        (lambda: KVStoreConfig("m", 16.0, dram), "block_size"),
        (lambda: KVStoreConfig("m", True, dram), "block_size"),
        (lambda: KVStoreConfig("", 16, dram), "model_id"),
        (lambda: KVStoreConfig(None, 16, dram), "model_id"),
        (lambda: KVStoreConfig("m", 16, 4), "dram"),
        (lambda: KVStoreConfig("m", 16, DiskTier(tmp_path, 4)), "dram"),
        (lambda: KVStoreConfig("m", 16, dram, tiers=(str(tmp_path),)), r"tiers\[0\]"),
        (lambda: KVStoreConfig("m", 16, dram, tiers=(dram,)), r"tiers\[0\]"),
        (lambda: KVStoreConfig("m", 16, dram, tiers=DiskTier(tmp_path, 4)), "tiers"),
        (
            lambda: KVStoreConfig("m", 16, dram, tiers=(DiskTier(tmp_path, 4, name="dram"),)),
            r"tiers\[0\]",
        ),
        (lambda: KVStoreConfig("m", 16, dram, writeback_policy="x"), "writeback_policy"),
        (lambda: KVStoreConfig("m", 16, dram, writeback_max_bytes=0), "writeback_max_bytes"),
        (lambda: KVStoreConfig("m", 16, dram, path="y"), "path"),
        (lambda: KVStoreConfig("m", 16, dram, block_axis=-1), "block_axis"),
        (lambda: KVStoreConfig("m", 16, dram, key_scheme=object()), "key_scheme"),
        (lambda: DramTier(0), "dram.capacity_blocks"),
        (lambda: DramTier(2.5), "dram.capacity_blocks"),
        (lambda: DiskTier("", 4), "disk.directory"),
        (lambda: DiskTier(None, 4), "disk.directory"),
        (lambda: DiskTier(tmp_path, 0), "disk.capacity_blocks"),
        (lambda: SharedFsTier(3), "shared_fs.directory"),
        (lambda: SharedFsTier(tmp_path, 0), "shared_fs.capacity_blocks"),
    ]
    for make, argument in cases:
        with pytest.raises(InvalidArgumentError, match=rf"^{argument}: "):
            make()


def test_closed_store(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 2 * BS)
    store.save(tokens, [0, 1])
    store.offload_session_async("s", tokens, [0, 1]).result(TIMEOUT)
    hit = store.lookup(tokens)
    with pytest.warns(ResourceWarning, match="1 lookup handle still open"):
        store.close()  # the handle open on purpose: close warns and invalidates it
    store.close()  # idempotent
    assert not hit.open
    calls = [
        lambda: store.lookup(tokens),
        lambda: store.lookup_async(tokens),
        lambda: store.save(tokens, [0, 1]),
        lambda: store.save_async(tokens, [0, 1]),
        lambda: store.load(hit, [2, 3]),
        lambda: store.prefetch(tokens),
        lambda: store.purge(),
        lambda: store.offload_session_async("t", tokens, [0, 1]),
        lambda: store.restore_session("s", [2, 3]),
        lambda: store.drop_session("s"),
        store.warmup,
    ]
    before = kv.snapshot()
    for call in calls:
        with pytest.raises(InvalidArgumentError, match=r"closed"):
            call()
    with pytest.raises(StaleHandleError):
        store.release(hit)
    assert same(kv.snapshot(), before) and kv.held() == [[]] * N_POOLS


# --- stats, close -------------------------------------------------------------------------------


def test_stats_shape(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 8, disk=16, shared=32), kv.pools)
    tokens = prompt(rng, 2 * BS)
    store.save(tokens, [0, 1])
    store.load(store.lookup(tokens), [5, 6])
    assert store.flush(TIMEOUT)
    stats = store.stats()
    assert set(stats) == {"store", "tiers"}
    s = stats["store"]
    for name in (
        "lookups", "lookup_blocks", "hit_blocks", "loads", "loaded_blocks", "load_misses",
        "saves", "saved_blocks", "save_skipped_blocks", "prefetched_blocks",
        "writeback_pending_bytes", "sessions", "open_handles",
    ):  # fmt: skip
        assert isinstance(s[name], int), name
    assert (s["lookups"], s["lookup_blocks"], s["hit_blocks"]) == (1, 2, 2)
    assert (s["loads"], s["loaded_blocks"], s["saves"], s["saved_blocks"]) == (1, 2, 1, 2)
    assert list(stats["tiers"]) == ["dram", "disk", "shared_fs"]
    expected_capacity = {"dram": 8, "disk": 16, "shared_fs": 32}
    for name, tier in stats["tiers"].items():
        assert tier["capacity"] == expected_capacity[name]
        assert tier["used"] == 2
        for counter in ("hits", "misses", "puts", "bytes_in", "bytes_out", "checksum_failures",
                        "evictions"):  # fmt: skip
            assert isinstance(tier[counter], int), (name, counter)
    assert stats["tiers"]["dram"]["hits"] == 2
    assert stats["tiers"]["disk"]["puts"] == 2
    assert "KVCacheStore(model_id='test-model'" in repr(store)


def test_close_flushes_and_the_context_manager(arrays, rng, tmp_path):
    kv = Kv(arrays, rng)
    config = make_config(tmp_path, 8, disk=16)
    tokens = prompt(rng, 3 * BS)
    expected = kv.blocks([7, 8, 9])
    with KVCacheStore(config, kv.pools) as store:
        future = store.save_async(tokens, [7, 8, 9])
    assert future.result(0).stored_blocks == 3  # close() waited for the save
    with pytest.raises(InvalidArgumentError, match="closed"):
        store.lookup(tokens)
    store.close()
    with KVCacheStore(config, kv.pools) as again:  # close() wrote the blocks down
        assert again.dram.used == 0
        assert hits(again, tokens) == (3, ("disk",) * 3)
        before = kv.snapshot()
        assert again.load(again.lookup(tokens), [30, 31, 32]).loaded_blocks == 3
        kv.check([30, 31, 32], expected, before)


# --- property: the longest cached prefix ---------------------------------------------------------


def test_lookup_finds_the_longest_saved_prefix(arrays, rng):
    """Prompts over a tiny alphabet share prefixes; a lookup hits exactly the full blocks whose
    whole prefix was saved (DRAM large enough to never evict)."""
    bs = 4
    kv = Kv(arrays, rng, bs=bs)
    config = dataclasses.replace(make_config(None, 64), block_size=bs)
    words = st.lists(st.integers(0, 2), min_size=0, max_size=14)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(saves=st.lists(words, max_size=5), queries=st.lists(words, min_size=1, max_size=5))
    def run(saves, queries):
        with KVCacheStore(config, kv.pools) as store:
            prefixes: set[tuple[int, ...]] = set()
            for tokens in saves:
                n = len(tokens) // bs
                store.save(tokens, list(range(n)))
                prefixes.update(tuple(tokens[: (j + 1) * bs]) for j in range(n))
            for tokens in queries:
                n = 0
                while n < len(tokens) // bs and tuple(tokens[: (n + 1) * bs]) in prefixes:
                    n += 1
                with store.lookup(tokens) as hit:
                    assert hit.cached_tokens == n * bs
                    assert hit.total_tokens == len(tokens)
            assert store.dram.used == len(prefixes)

    run()


def test_offload_session_blocking_form(arrays, rng, stores):
    """offload_session() waits until the session is durable and returns its SaveResult; the
    device blocks are free at once."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 8), kv.pools)
    tokens = prompt(rng, 2 * BS + 3)
    expected = kv.blocks([0, 1, 2])
    result = store.offload_session("blocking", tokens, [0, 1, 2])
    assert isinstance(result, SaveResult) and result.stored_blocks == 3
    assert kv.held() == [[]] * N_POOLS
    restored = store.restore_session("blocking", [10, 11, 12])
    assert restored.loaded_tokens == len(tokens)
    assert same([b[[10, 11, 12]] for b in kv.snapshot()], expected)


# --- serving peers: DRAM and disk listed, disk blocks moved up for a peer -----------------------


def test_serve_lists_dram_and_disk_and_serves_disk_blocks_to_peers(
    arrays, rng, stores, tmp_path, shm_names
):
    """A store serving peers (``serve``) lists every block DRAM or disk holds; a peer's pull
    of a block only on disk moves it up first. After a restart the node lists at once what
    /dev/shm and disk still hold; a block that leaves both tiers is withdrawn."""
    from tpusync._src.cluster import serving
    from tpusync.cluster import MemoryRegistry, RegistryTier

    secret = b"k" * 32
    registry = MemoryRegistry()
    name = shm_names()
    kv = Kv(arrays, rng)
    owner = stores(make_config(tmp_path, 16, disk=32, name=name), kv.pools)
    first, second = prompt(rng, 3 * BS), prompt(rng, 2 * BS)
    owner.save(first, [1, 2, 3])
    owner.save(second, [4, 5])
    expected = kv.blocks([1, 2, 3])
    assert owner.flush(TIMEOUT)
    owner.evict(first, tier="dram")  # now only on disk
    server = serving.serve(owner, registry, "owner", secret=secret, ttl_s=30)
    assert owner.flush(TIMEOUT)
    listed = lambda tokens: [bool(h) for h in registry.holders(keys_of(owner, tokens))]  # noqa: E731
    assert listed(first) == [True] * 3 and listed(second) == [True] * 2
    assert [n.addresses for n in registry.nodes()] == [(server.address,)]

    peer_kv = Kv(arrays, rng)
    cluster = RegistryTier(registry, secret=secret, exclude="peer")
    peer = stores(make_config(tiers=(cluster,)), peer_kv.pools)
    try:
        hit = peer.lookup(first)
        assert hit.tiers == ("cluster",) * 3
        before = peer_kv.snapshot()
        assert peer.load(hit, [10, 11, 12]).loaded_blocks == 3
        peer_kv.check([10, 11, 12], expected, before)
    finally:
        peer.close()  # and with it the cluster tier
    assert hits(owner, first) == (3, ("dram",) * 3)  # moved up to serve the peer

    # evicted from DRAM while on disk: still listed; dropped from disk too: withdrawn
    owner.evict(second, tier="dram")
    assert owner.flush(TIMEOUT) and listed(second) == [True] * 2
    owner.evict(second, tier="disk")
    assert owner.flush(TIMEOUT) and listed(second) == [False] * 2

    owner.evict(first, tier="dram")
    owner.close()
    assert registry.nodes() == []  # unregistered
    again = stores(make_config(tmp_path, 16, disk=32, name=name), kv.pools)
    serving.serve(again, registry, "owner", secret=secret, ttl_s=30)
    assert listed(first) == [True] * 3  # published at start: disk blocks included
    assert again.dram.contains(keys_of(again, first)) == [False] * 3


# --- other pools of the store's layout (an engine's staging buffer) --------------------------


def _hashes(rng: np.random.Generator, n: int) -> list[bytes]:
    return [rng.bytes(32) for _ in range(n)]


@pytest.mark.parametrize("case", ["dram", "through a disk tier"])
def test_save_from_and_load_into_other_pools_of_the_layout(arrays, rng, stores, tmp_path, case):
    kv = Kv(arrays, rng)
    staging = Kv(arrays, rng, blocks=12)  # fewer blocks than the store's pools
    config = make_config(dram=16) if case == "dram" else make_config(tmp_path, dram=4, disk=64)
    store = stores(config, kv.pools)
    hashes = _hashes(rng, 10)
    saved_ids = [11, 3, 0, 7, 5, 1, 9, 2, 10, 4]
    expected = staging.blocks(saved_ids)
    own_before = kv.snapshot()
    result = store.save_engine_blocks_async(hashes, saved_ids, pools=staging.pools).result(TIMEOUT)
    assert result.stored_blocks == 10
    assert staging.held() == [[]] * N_POOLS
    kv.check([], [b[:0] for b in own_before], own_before)  # the store's own pools: unchanged
    # into the store's own pools
    hit = store.lookup_engine_blocks(hashes)
    assert hit.num_blocks == 10
    assert store.load(hit, list(range(20, 30))).loaded_blocks == 10
    kv.check(range(20, 30), expected)
    # and into other pools again
    target = Kv(arrays, rng, blocks=10)
    before = target.snapshot()
    hit = store.lookup_engine_blocks(hashes[:6])
    assert store.load(hit, [5, 4, 3, 2, 1, 0], pools=target.pools).loaded_blocks == 6
    target.check([5, 4, 3, 2, 1, 0], [b[:6] for b in expected], before)


def test_other_pools_of_another_layout_are_refused(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(dram=16), kv.pools)
    hashes = _hashes(rng, 2)
    store.save_engine_blocks_async(hashes, [0, 1]).result(TIMEOUT)
    wrong_dtype = Kv(arrays, rng, np.float32, blocks=4)
    wrong_shape = Kv(arrays, rng, blocks=4, bs=8)
    for other in (wrong_dtype, wrong_shape):
        with pytest.raises(InvalidArgumentError, match=r"pools: their blocks are not this"):
            store.save_engine_blocks_async(_hashes(rng, 2), [0, 1], pools=other.pools)
        hit = store.lookup_engine_blocks(hashes)
        before = other.snapshot()
        with pytest.raises(InvalidArgumentError, match=r"pools: their blocks are not this"):
            store.load(hit, [0, 1], pools=other.pools)
        assert hit.open  # refused before anything moved: the handle is still the caller's
        store.release(hit)
        assert same(other.snapshot(), before)
    small = Kv(arrays, rng, blocks=4)
    with pytest.raises(BlockIndexError, match=r"0\.\.3"):
        store.save_engine_blocks_async(_hashes(rng, 2), [0, 4], pools=small.pools)
    with pytest.raises(InvalidArgumentError, match=r"pools: .*list"):
        store.save_engine_blocks_async(_hashes(rng, 1), [0], pools=small.pools[0])
    assert counters(store)["saves"] == 1


def test_a_lookup_in_dram_answers_only_a_hit_dram_holds_whole_and_never_waits(
    arrays, rng, stores, tmp_path
):
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, dram=4, disk=64), kv.pools)
    hashes = _hashes(rng, 6)
    store.save_engine_blocks_async(hashes, list(range(6))).result(TIMEOUT)
    store.flush(timeout=TIMEOUT)
    # DRAM holds 4 slots: the 6 blocks are all on disk, the last 4 in DRAM too
    hit = store.lookup_engine_blocks_in_dram(hashes[2:])
    assert hit is not None and hit.num_blocks == 4 and set(hit.tiers) == {"dram"}
    assert hit.cached_tokens == 4 * BS and counters(store)["open_handles"] == 1
    before = kv.snapshot()
    assert store.load(hit, [10, 11, 12, 13]).loaded_blocks == 4
    kv.check([10, 11, 12, 13], [b[2:6] for b in kv.blocks(range(6))], before)
    # a block below DRAM: no answer and nothing pinned; the full lookup finds all of them
    assert store.lookup_engine_blocks_in_dram(hashes) is None
    assert store.lookup_engine_blocks_in_dram([*hashes[2:], _hashes(rng, 1)[0]]) is None
    assert counters(store)["open_handles"] == 0
    store.release(full := store.lookup_engine_blocks(hashes))
    assert full.num_blocks == 6
    # the store's lock held elsewhere (a lower tier answering over the network): no wait
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store._stack.lock:
            held.set()
            done.wait(5.0)  # a lookup that waited for it would take 5 s

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(TIMEOUT)
        started = time.monotonic()
        assert store.lookup_engine_blocks_in_dram(hashes[2:]) is None
        assert time.monotonic() - started < 1.0
    finally:
        done.set()
        holder.join(TIMEOUT)
    assert counters(store)["open_handles"] == 0
    store.release(again := store.lookup_engine_blocks_in_dram(hashes[2:]))  # the lock is free
    assert again is not None and again.num_blocks == 4


def test_a_lookup_in_dram_of_a_store_without_lower_tiers_answers_dram_s_leading_run(
    arrays, rng, stores
):
    kv = Kv(arrays, rng)
    store = stores(make_config(dram=16), kv.pools)
    hashes = _hashes(rng, 6)
    store.save_engine_blocks_async(hashes[:4], list(range(4))).result(TIMEOUT)
    hit = store.lookup_engine_blocks_in_dram(hashes)  # nothing below DRAM can hold the rest
    assert hit is not None and hit.num_blocks == 4 and hit.total_tokens == 6 * BS
    store.release(hit)
    miss = store.lookup_engine_blocks_in_dram(hashes[4:])
    assert miss is not None and miss.num_blocks == 0
    store.release(miss)
    assert counters(store)["open_handles"] == 0
