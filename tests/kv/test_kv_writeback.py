"""Write-back of saved blocks to every lower tier, when DRAM evicts blocks still queued for it.

Every test runs real tiers (an anonymous DRAM pool, a DiskPool and a SharedFsPool in the test's
temporary directory) and real DevicePools of random bits on the fake CPU devices. The store's
write-back thread is held back deterministically: a gate on the disk tier's ``contains`` stops it
(and only it) at its first look at a lower tier, before it takes any lock, so the blocks of later
saves stay queued while DRAM evicts them. The gate only waits; the disk tier then answers as
always. What reached the shared filesystem is read back, bit for bit, by a second store that has
no tier but its own DRAM and that shared filesystem (what another host sees).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

from tpusync import DevicePool
from tpusync._src.kv.keys import check_tokens
from tpusync.kv import DiskTier, DramTier, KVCacheStore, KVStoreConfig, SharedFsTier

NB, BS, HEADS, DIM, N_POOLS = 32, 16, 2, 8, 2  # device pools: (NB, BS, HEADS, DIM) each
DTYPE = np.dtype(ml_dtypes.bfloat16)
TIMEOUT = 20.0
VOCAB = 50_000


# --- device pools, stores, keys ----------------------------------------------------------------


class Kv:
    """The engine's KV arrays: device pools of random bits (never zeros), read back as bits."""

    def __init__(self, arrays: Any, rng: np.random.Generator) -> None:
        self.arrays = arrays
        self.pools = [
            DevicePool(
                jax.device_put(arrays.random(rng, (NB, BS, HEADS, DIM), DTYPE)), name=f"kv{i}"
            )
            for i in range(N_POOLS)
        ]

    def blocks(self, ids: Sequence[int]) -> list[np.ndarray]:
        return [np.array(self.arrays.bits(p.array)[list(ids)], copy=True) for p in self.pools]

    def check(self, ids: Sequence[int], expected: list[np.ndarray], what: str) -> None:
        for i, (now, want) in enumerate(zip(self.blocks(ids), expected, strict=True)):
            self.arrays.assert_same(now, want, f"{what}, pool {i}")


def config(
    tmp_path: Path, dram: int, *, disk: int | None = None, shared: int | None = None
) -> KVStoreConfig:
    """DRAM of ``dram`` blocks, a disk tier when ``disk``, and always the shared filesystem in
    ``tmp_path / "shared"`` (``shared`` blocks at most; None: unbounded)."""
    return KVStoreConfig(
        model_id="test-model",
        block_size=BS,
        dram=DramTier(dram, populate=False),
        tiers=(
            *([DiskTier(tmp_path / "disk", disk, create=True)] if disk else []),
            SharedFsTier(tmp_path / "shared", shared, create=True),
        ),
    )


def prompt(rng: np.random.Generator, blocks: int) -> list[int]:
    return rng.integers(0, VOCAB, size=blocks * BS).tolist()


def keys_of(store: KVCacheStore, tokens: list[int]) -> list[bytes]:
    return store.scheme.block_keys(store.namespace, check_tokens(tokens), BS)


def counters(store: KVCacheStore) -> dict[str, Any]:
    return store.stats()["store"]


class WritebackGate:
    """Holds the store's write-back thread at its first look at the disk tier (no lock held
    there) until :meth:`open`; every other thread, and the write-back thread afterwards, passes
    straight to the real ``contains``."""

    def __init__(self, store: KVCacheStore) -> None:
        self._stack = store._stack
        self._disk = store._stack.tiers[store._stack.names.index("disk")]
        self._contains = self._disk.contains
        self.entered = threading.Event()
        self._opened = threading.Event()
        self._disk.contains = self._gated  # an instance attribute shadows the method

    def _gated(self, keys: Sequence[bytes]) -> list[bool]:
        writer = self._stack.writeback._thread
        if threading.current_thread() is writer and not self._opened.is_set():
            self.entered.set()
            if not self._opened.wait(TIMEOUT):
                raise TimeoutError("the write-back gate was never opened")
        return self._contains(keys)

    def open(self) -> None:
        self._opened.set()
        del self._disk.contains


@pytest.fixture
def gated(stores, tmp_path) -> Iterator[Callable[..., tuple[KVCacheStore, WritebackGate]]]:
    """A store with DRAM, disk and shared filesystem whose write-back waits at a gate; the gate
    is opened at the end of the test whatever happens, so closing the store never hangs."""
    gates: list[WritebackGate] = []

    def open_(kv: Kv, dram: int, shared: int | None = None) -> tuple[KVCacheStore, WritebackGate]:
        store = stores(config(tmp_path, dram, disk=4 * NB, shared=shared), kv.pools)
        gates.append(WritebackGate(store))
        return store, gates[-1]

    yield open_
    for gate in gates:
        if not gate._opened.is_set():
            gate.open()


def hold_first_writeback(store: KVCacheStore, gate: WritebackGate, tokens: list[int]) -> None:
    """Saves ``tokens`` from device blocks 0.. and waits until the write-back thread has taken
    them and stopped at the gate: blocks saved from now on stay queued."""
    store.save(tokens, list(range(len(tokens) // BS)))
    assert gate.entered.wait(TIMEOUT), "the write-back thread never reached the gate"


def assert_shared_serves(
    arrays: Any,
    rng: np.random.Generator,
    stores: Callable[..., KVCacheStore],
    tmp_path: Path,
    saved: list[tuple[list[int], list[np.ndarray]]],
) -> None:
    """A second store that sees only the shared filesystem finds every saved prompt whole there
    and loads it bit for bit."""
    kv = Kv(arrays, rng)  # other random bits: a load must overwrite them
    reader = stores(config(tmp_path, 2 * NB), kv.pools)
    assert reader.config.tier("disk") is None
    for n, (tokens, expected) in enumerate(saved):
        hit = reader.lookup(tokens)
        blocks = len(tokens) // BS
        assert hit.tiers == ("shared_fs",) * blocks, f"prompt {n}: {hit.tiers}"
        dst = list(range(NB - blocks, NB))
        assert reader.load(hit, dst).loaded_blocks == blocks
        kv.check(dst, expected, f"prompt {n} read from the shared filesystem")


# --- eviction of queued blocks -----------------------------------------------------------------


def test_save_evicting_queued_blocks_still_writes_them_to_the_shared_fs(
    arrays, rng, stores, gated, tmp_path
):
    kv = Kv(arrays, rng)
    store, gate = gated(kv, dram=6)
    a, b, c = prompt(rng, 2), prompt(rng, 4), prompt(rng, 4)
    saved = [(a, kv.blocks([0, 1])), (b, kv.blocks([2, 3, 4, 5])), (c, kv.blocks([6, 7, 8, 9]))]
    hold_first_writeback(store, gate, a)  # a: taken by write-back, so never a victim
    store.save(b, [2, 3, 4, 5])  # DRAM full; b queued
    store.save(c, [6, 7, 8, 9])  # evicts all of b while it waits for write-back
    stack = store._stack
    assert store.dram.contains(keys_of(store, b)) == [False] * 4
    assert stack.tiers[1].contains(keys_of(store, b)) == [True] * 4  # demoted to disk
    gate.open()
    assert store.flush(TIMEOUT)

    shared = stack.tiers[stack.names.index("shared_fs")]
    for tokens, _ in saved:
        assert shared.contains(keys_of(store, tokens)) == [True] * (len(tokens) // BS)
    stats = counters(store)
    assert stats["writeback_lost"] == 0
    assert stats["writeback_failed"] == 0
    assert stats["demotions"] == 4
    assert stats["writeback_on_demote"] == 4  # b, into the shared filesystem
    assert stats["writeback_written"] == 2 * 10 - 4  # every block twice, less b's demotions
    assert_shared_serves(arrays, rng, stores, tmp_path, saved)


def test_evict_of_a_queued_block_still_writes_it_to_the_shared_fs(
    arrays, rng, stores, gated, tmp_path
):
    kv = Kv(arrays, rng)
    store, gate = gated(kv, dram=16)
    a, b = prompt(rng, 2), prompt(rng, 3)
    saved = [(a, kv.blocks([0, 1])), (b, kv.blocks([2, 3, 4]))]
    hold_first_writeback(store, gate, a)
    store.save(b, [2, 3, 4])  # queued
    # White box: KVCacheStore.evict flushes the write-back first, so only the stack's evict
    # (what making room runs) meets a queued block.
    assert store._stack.evict(0, keys_of(store, b)) == 3
    assert store.dram.contains(keys_of(store, b)) == [False] * 3
    gate.open()
    assert store.flush(TIMEOUT)

    assert_shared_serves(arrays, rng, stores, tmp_path, saved)
    stats = counters(store)
    assert (stats["writeback_lost"], stats["writeback_failed"]) == (0, 0)
    assert (stats["demotions"], stats["writeback_on_demote"]) == (3, 3)


def test_a_failing_shared_fs_neither_stops_eviction_nor_hides_the_lost_write_back(
    arrays, rng, stores, gated, tmp_path
):
    """The shared filesystem holds 3 blocks: the 4 queued victims cannot go there at once. DRAM
    evicts them anyway (they rest on disk), and write-back counts them lost for that tier."""
    kv = Kv(arrays, rng)
    store, gate = gated(kv, dram=6, shared=3)
    a, b, c = prompt(rng, 2), prompt(rng, 4), prompt(rng, 4)
    expected_b = kv.blocks([2, 3, 4, 5])
    hold_first_writeback(store, gate, a)
    store.save(b, [2, 3, 4, 5])
    store.save(c, [6, 7, 8, 9])  # evicts b; the shared filesystem refuses 4 blocks
    assert store.dram.contains(keys_of(store, b)) == [False] * 4
    assert counters(store)["writeback_failed"] == 4
    gate.open()
    assert store.flush(TIMEOUT)

    stack = store._stack
    shared = stack.tiers[stack.names.index("shared_fs")]
    assert shared.contains(keys_of(store, b)) == [False] * 4
    stats = counters(store)
    assert stats["writeback_lost"] == 4  # b: on disk only
    assert stats["writeback_on_demote"] == 0
    hit = store.lookup(b)
    assert hit.tiers == ("disk",) * 4
    assert store.load(hit, [20, 21, 22, 23]).loaded_blocks == 4
    kv.check([20, 21, 22, 23], expected_b, "b read back from disk")


def test_two_writers_of_the_same_blocks_write_and_announce_them_once(arrays, rng, stores, tmp_path):
    """Write-back and a demotion of a block still queued for it can both find it absent from a
    tier (each looks before taking the tier's room lock); whichever gets the lock second writes
    nothing and announces nothing. White box: two ``_put_down`` calls are what the two writers
    do then, beside the store's own write-back of the same blocks."""
    kv = Kv(arrays, rng)
    store = stores(config(tmp_path, 16, disk=4 * NB), kv.pools)
    events: list[tuple[str, str, list[bytes]]] = []
    store.add_block_listener(lambda kind, tier, keys: events.append((kind, tier, list(keys))))
    tokens = prompt(rng, 3)
    store.save(tokens, [0, 1, 2])
    keys = keys_of(store, tokens)
    stack = store._stack
    disk = stack.names.index("disk")
    written = [stack._put_down(disk, keys), stack._put_down(disk, keys)]
    assert store.flush(TIMEOUT)
    assert written in ([3, 0], [0, 0])  # [0, 0]: the write-back thread was first
    announced = [k for kind, tier, ks in events if kind == "stored" and tier == "disk" for k in ks]
    assert sorted(announced) == sorted(keys)  # each block once
    assert stack.tiers[disk].contains(keys) == [True] * 3
