"""A full or failing tier never stops the tiers beside it, through a real KVCacheStore.

Real tiers only: an anonymous DRAM pool, disk tiers in the test's temporary directory or on a
small tmpfs mounted for the test (a real full filesystem: its slab files do not fit), a shared
filesystem directory (or one on a tiny tmpfs), and DevicePools of random bits on the fake CPU
devices. Blocks are read back bit for bit.

* a disk tier whose slab no longer fits on its filesystem (filled after the store started; one
  that cannot fit is refused at start): every save still succeeds, the shared filesystem gets
  every block, DRAM keeps evicting, and one log line names the tier and its path;
* a DRAM tier smaller than a save streams the save into the disk tier, and loads it back;
* a full disk tier (its capacity, or its filesystem) evicts its least recently used unpinned
  blocks instead of failing;
* a block damaged on disk (or in DRAM) is served from the next tier that holds it intact.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from mounts import tmpfs

from tpusync import DevicePool
from tpusync._src.kv.keys import check_tokens
from tpusync._src.tiers.disk.pool import HEADER_BYTES
from tpusync._src.tiers.layout import PoolLayout
from tpusync.errors import TierFullError
from tpusync.kv import (
    DiskTier,
    DramTier,
    ExistingTier,
    KVCacheStore,
    KVStoreConfig,
    SharedFsTier,
)
from tpusync.tiers import DiskPool

NB, BS, HEADS, DIM, N_POOLS = 64, 16, 2, 8, 2  # device pools: (NB, BS, HEADS, DIM) each
DTYPE = np.dtype(ml_dtypes.bfloat16)
VOCAB = 50_000
TIMEOUT = 20.0


class Kv:
    """The engine's KV arrays: device pools of random bits (never zeros), read back as bits."""

    def __init__(self, arrays: Any, rng: np.random.Generator) -> None:
        self.arrays, self.rng = arrays, rng
        self.pools = [DevicePool(self._random(), name=f"kv{i}") for i in range(N_POOLS)]

    def _random(self) -> jax.Array:
        return jax.device_put(self.arrays.random(self.rng, (NB, BS, HEADS, DIM), DTYPE))

    def refill(self) -> None:
        """New random bits in every block, as the engine's next steps would write."""
        for pool in self.pools:
            pool.update(self._random())

    def blocks(self, ids: Sequence[int]) -> list[np.ndarray]:
        return [np.array(self.arrays.bits(p.array)[list(ids)], copy=True) for p in self.pools]

    def check(self, ids: Sequence[int], expected: list[np.ndarray], what: str) -> None:
        for i, (now, want) in enumerate(zip(self.blocks(ids), expected, strict=True)):
            self.arrays.assert_same(now, want, f"{what}, pool {i}")

    def layout(self) -> PoolLayout:
        return PoolLayout.from_pools("test-model", self.pools, block_axis=0)


def make_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def config(
    dram: int,
    *,
    disk: tuple[Path, int] | None = None,
    shared: Path | None = None,
    extra: tuple[tuple[str, Any], ...] = (),
) -> KVStoreConfig:
    return KVStoreConfig(
        model_id="test-model",
        block_size=BS,
        dram=DramTier(dram, populate=False),
        tiers=(
            *([DiskTier(make_dir(disk[0]), disk[1])] if disk else []),
            *([SharedFsTier(make_dir(shared))] if shared else []),
            *(ExistingTier(name, tier) for name, tier in extra),
        ),
    )


def take_the_room(mount: Path) -> None:
    """Leaves 512 KiB free on ``mount``, as another process filling the disk after the store
    started would (a store refuses at start a disk tier its filesystem cannot hold)."""
    free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
    fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free - (512 << 10))
    finally:
        os.close(fd)


def prompt(rng: np.random.Generator, blocks: int) -> list[int]:
    return rng.integers(0, VOCAB, size=blocks * BS).tolist()


def keys_of(store: KVCacheStore, tokens: list[int]) -> list[bytes]:
    return store.scheme.block_keys(store.namespace, check_tokens(tokens), BS)


def tier(store: KVCacheStore, name: str) -> Any:
    return store._stack.tiers[store._stack.names.index(name)]


def counters(store: KVCacheStore) -> dict[str, Any]:
    return store.stats()["store"]


def tier_failure_lines(caplog: pytest.LogCaptureFixture, name: str, where: Path) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tpusync.kv"
        and f"tier {name} ({where})" in r.getMessage()
        and " failed: " in r.getMessage()
    ]


def save_prompts(
    store: KVCacheStore, kv: Kv, rng: np.random.Generator, n: int, blocks: int
) -> list[tuple[list[int], list[np.ndarray]]]:
    """Saves ``n`` prompts of ``blocks`` blocks from device blocks 0.., new bits each time;
    every save must store all of its blocks. Returns (tokens, the blocks' bits) of each."""
    saved = []
    for i in range(n):
        kv.refill()
        tokens = prompt(rng, blocks)
        ids = list(range(blocks))
        assert store.save(tokens, ids).stored_blocks == blocks, f"save {i}"
        saved.append((tokens, kv.blocks(ids)))
    return saved


def load_back(
    store: KVCacheStore, kv: Kv, saved: list[tuple[list[int], list[np.ndarray]]], what: str
) -> None:
    """Every saved prompt is a full hit and loads bit for bit into device blocks 32.."""
    for n, (tokens, expected) in enumerate(saved):
        blocks = len(tokens) // BS
        hit = store.lookup(tokens)
        assert hit.num_blocks == blocks, f"{what}: prompt {n}: {hit.tiers}"
        dst = list(range(32, 32 + blocks))
        assert store.load(hit, dst).loaded_blocks == blocks, f"{what}: prompt {n}"
        kv.check(dst, expected, f"{what}: prompt {n}")


# --- 1. a disk tier that cannot grow stops neither the shared filesystem nor DRAM ------------


def test_a_disk_tier_that_cannot_grow_does_not_stop_the_shared_fs_tier(
    arrays, rng, stores, tmp_path, caplog
):
    """The disk tier's one 16 MiB slab no longer fits on its tmpfs (filled after the store
    started). Before: 114 of 120
    saves failed with TierFullError (DRAM could not demote) and the shared filesystem got
    nothing. Now every save succeeds, the shared filesystem gets every block, and the disk
    tier's failure is logged once, with its path."""
    caplog.set_level(logging.WARNING, logger="tpusync.kv")
    kv = Kv(arrays, rng)
    capacity = (16 << 20) // kv.layout().slot_bytes
    with tmpfs(tmp_path / "mnt", "size=20m") as mnt:
        disk_dir = mnt / "disk"
        store = stores(config(8, disk=(disk_dir, capacity), shared=tmp_path / "shared"), kv.pools)
        take_the_room(mnt)
        saved = save_prompts(store, kv, rng, 120, 1)
        assert store.flush(TIMEOUT)

        every_key = [k for tokens, _ in saved for k in keys_of(store, tokens)]
        assert tier(store, "shared_fs").contains(every_key) == [True] * len(every_key)
        assert tier(store, "disk").used == 0
        stats = counters(store)
        assert stats["writeback_failed"] > 0
        assert stats["evicted_unsaved"] == 0  # the shared filesystem took every victim
        assert stats["evictions"] >= 120 - 8
        lines = tier_failure_lines(caplog, "disk", disk_dir)
        assert len(lines) == 1, lines  # once, not per block
        assert "the other tiers still get the blocks" in lines[0]
        assert tier_failure_lines(caplog, "shared_fs", tmp_path / "shared") == []
        load_back(store, kv, saved, "after a disk tier with no room")
        store.close()


def test_dram_still_evicts_when_no_lower_tier_has_room(arrays, rng, stores, tmp_path, caplog):
    """Neither lower tier has room (the disk's slab no longer fits: its filesystem was filled
    after the store started; the shared filesystem is a 64 KiB tmpfs). Saves still succeed:
    DRAM drops victims no tier could take (a loss of cache, counted), keeps the newest blocks,
    and each tier's failure is logged with its path."""
    caplog.set_level(logging.WARNING, logger="tpusync.kv")
    kv = Kv(arrays, rng)
    capacity = (16 << 20) // kv.layout().slot_bytes
    with (
        tmpfs(tmp_path / "mnt", "size=20m") as mnt,
        tmpfs(tmp_path / "shared", "size=64k") as shared_dir,
    ):
        disk_dir = mnt / "disk"
        store = stores(config(8, disk=(disk_dir, capacity), shared=shared_dir), kv.pools)
        take_the_room(mnt)
        saved = save_prompts(store, kv, rng, 40, 1)
        assert store.flush(TIMEOUT)
        stats = counters(store)
        assert stats["evicted_unsaved"] > 0
        assert store.dram.used == 8
        assert len(tier_failure_lines(caplog, "disk", disk_dir)) == 1
        assert len(tier_failure_lines(caplog, "shared_fs", shared_dir)) == 1
        load_back(store, kv, saved[-8:], "the newest blocks, from DRAM")
        store.close()


def test_session_blocks_stay_in_dram_when_no_lower_tier_takes_them(arrays, rng, stores, tmp_path):
    """The only lower tier has no room: a session's blocks cannot be demoted, so DRAM keeps
    them and evicts around them at once (no wait for a tier that will not take them); a save
    that would need them fails fast; the session restores whole."""
    kv = Kv(arrays, rng)
    capacity = (16 << 20) // kv.layout().slot_bytes
    with tmpfs(tmp_path / "mnt", "size=20m") as mnt:
        store = stores(config(8, disk=(mnt / "disk", capacity)), kv.pools)
        take_the_room(mnt)
        session = prompt(rng, 4)
        expected = kv.blocks([0, 1, 2, 3])
        store.offload_session("s", session, [0, 1, 2, 3])
        start = time.monotonic()
        saved = save_prompts(store, kv, rng, 10, 1)  # cycles the 4 other slots
        with pytest.raises(TierFullError, match="held by sessions"):
            store.save(prompt(rng, 5), [10, 11, 12, 13, 14])
        assert time.monotonic() - start < 10.0  # no waiting on a tier that will not take them
        assert counters(store)["evicted_unsaved"] == 6
        load_back(store, kv, saved[-4:], "the newest blocks")
        restored = store.restore_session("s", [40, 41, 42, 43])
        assert restored.loaded_tokens == len(session)
        kv.check([40, 41, 42, 43], expected, "the session")
        store.close()


# --- 2. a save (and a load) larger than DRAM streams through it ------------------------------


def test_a_save_larger_than_dram_streams_into_the_disk_tier(arrays, rng, stores, tmp_path):
    """DRAM holds 4 blocks, the disk tier 64: a 20-block save is stored whole (before: refused,
    "do not fit in its 4 slots"), its prefix is found in full and loads bit for bit, also when
    every block rests on disk alone."""
    kv = Kv(arrays, rng)
    store = stores(config(4, disk=(tmp_path / "disk", 64)), kv.pools)
    tokens = prompt(rng, 20)
    expected = kv.blocks(range(20))
    result = store.save(tokens, list(range(20)))
    assert result.stored_blocks == 20 and result.bytes == 20 * store.layout.payload_bytes
    assert store.flush(TIMEOUT)
    assert counters(store)["saves_streamed"] == 1
    keys = keys_of(store, tokens)
    assert tier(store, "disk").contains(keys) == [True] * 20
    assert store.dram.contains(keys[-4:]) == [True] * 4  # DRAM keeps the last chunk

    hit = store.lookup(tokens)
    assert hit.cached_tokens == 20 * BS  # before: capped at DRAM's 4 blocks
    assert hit.tiers == ("disk",) * 16 + ("dram",) * 4
    loaded = store.load(hit, list(range(24, 44)))
    assert loaded.loaded_blocks == 20 and loaded.promoted_blocks == 16
    kv.check(range(24, 44), expected, "a 20-block prefix loaded through 4 DRAM slots")

    assert store.evict(tokens, tier="dram") > 0
    hit = store.lookup(tokens)
    assert hit.tiers == ("disk",) * 20
    kv.refill()  # other bits in the destination: the load must overwrite them
    loaded = store.load(hit, list(range(44, 64)))
    assert loaded.loaded_blocks == 20 and loaded.promoted_blocks == 20
    kv.check(range(44, 64), expected, "a 20-block prefix from disk alone")
    assert counters(store)["open_handles"] == 0
    assert store.dram.used <= 4


def test_a_streamed_save_fits_around_pinned_dram_blocks(arrays, rng, stores, tmp_path):
    """Another handle pins 3 of DRAM's 4 slots: the streamed save goes on in 1-block chunks."""
    kv = Kv(arrays, rng)
    store = stores(config(4, disk=(tmp_path / "disk", 64)), kv.pools)
    pinned = prompt(rng, 3)
    store.save(pinned, [40, 41, 42])
    handle = store.lookup(pinned)
    tokens = prompt(rng, 10)
    expected = kv.blocks(range(10))
    assert store.save(tokens, list(range(10))).stored_blocks == 10
    assert store.dram.contains(list(handle.keys)) == [True] * 3  # the pins held
    store.release(handle)
    hit = store.lookup(tokens)
    assert hit.num_blocks == 10
    assert store.load(hit, list(range(20, 30))).loaded_blocks == 10
    kv.check(range(20, 30), expected, "10 blocks streamed past 3 pinned ones")


def test_a_streamed_save_stops_where_no_lower_tier_takes_a_chunk(arrays, rng, stores, tmp_path):
    """The only lower tier has no room: a 10-block save through 4 DRAM slots stores its first
    chunk (a cached prefix) and stops there, without an error: evicting that chunk for blocks
    that would follow an uncached one would only lose cache."""
    kv = Kv(arrays, rng)
    capacity = (16 << 20) // kv.layout().slot_bytes
    with tmpfs(tmp_path / "mnt", "size=20m") as mnt:
        store = stores(config(4, disk=(mnt / "disk", capacity)), kv.pools)
        take_the_room(mnt)
        tokens = prompt(rng, 10)
        expected = kv.blocks(range(4))
        result = store.save(tokens, list(range(10)))
        assert result.stored_blocks == 4
        assert counters(store)["save_unstored_blocks"] == 6
        hit = store.lookup(tokens)
        assert hit.tiers == ("dram",) * 4
        assert store.load(hit, [20, 21, 22, 23]).loaded_blocks == 4
        kv.check([20, 21, 22, 23], expected, "the stored prefix")
        store.close()


# --- 3. a full disk tier evicts its least recently used blocks --------------------------------


def test_a_full_disk_tier_evicts_its_least_recently_used_blocks(arrays, rng, stores, tmp_path):
    """A disk tier of 8 blocks under 2-block prompts: saves never fail; the disk keeps what was
    used last (a load touches it) and never drops a block a lookup pins."""
    kv = Kv(arrays, rng)
    store = stores(config(4, disk=(tmp_path / "disk", 8)), kv.pools)
    disk = tier(store, "disk")
    saved = []
    for _ in range(4):  # fills the disk
        saved += save_prompts(store, kv, rng, 1, 2)
        assert store.flush(TIMEOUT)
    load_back(store, kv, saved[:1], "prompt 0 (read from disk: now its newest)")
    saved += save_prompts(store, kv, rng, 1, 2)
    assert store.flush(TIMEOUT)
    assert disk.contains(keys_of(store, saved[0][0])) == [True, True]
    assert disk.contains(keys_of(store, saved[1][0])) == [False, False]  # the least recent

    handle = store.lookup(saved[0][0])  # pinned from now on
    saved += save_prompts(store, kv, rng, 6, 2)
    assert store.flush(TIMEOUT)
    assert disk.contains(list(handle.keys)) == [True, True]
    assert disk.used == 8
    assert disk.stats.evictions >= 6
    assert counters(store)["writeback_failed"] == 0
    assert store.load(handle, [40, 41]).loaded_blocks == 2
    kv.check([40, 41], saved[0][1], "the pinned prompt")
    load_back(store, kv, saved[-3:], "the newest prompts")


def test_a_disk_tier_whose_filesystem_is_full_evicts_instead_of_failing(
    arrays, rng, stores, tmp_path
):
    """A disk tier of 64 slots in slabs of 8 on a 160 KiB tmpfs that another file fills in
    part: only 2 slabs fit. The tier fills them, then evicts its least recently used blocks to
    reuse their slots; no write fails. Once the other file is gone, it grows again."""
    kv = Kv(arrays, rng)
    layout = kv.layout()
    with (
        tmpfs(tmp_path / "ssd", "size=160k") as ssd_dir,
        DiskPool(layout, 64, ssd_dir, slab_slots=8) as ssd,
    ):
        filler = ssd_dir / "other-files"
        filler.write_bytes(rng.bytes(64 << 10))
        store = stores(config(4, extra=(("ssd", ssd),)), kv.pools)
        saved = []
        for _ in range(12):
            saved += save_prompts(store, kv, rng, 1, 2)
            assert store.flush(TIMEOUT)
        assert ssd.usable_capacity == 16 and ssd.used == 16 and ssd.free == 0
        assert len(list(ssd_dir.glob("slab-*.tpd"))) == 2
        assert counters(store)["writeback_failed"] == 0
        newest = [k for tokens, _ in saved[-8:] for k in keys_of(store, tokens)]
        assert ssd.contains(newest) == [True] * 16
        assert ssd.stats.evictions == 8
        load_back(store, kv, saved[-8:], "the newest prompts")

        filler.unlink()  # room for 2 more slabs
        assert ssd.usable_capacity == 32
        saved += save_prompts(store, kv, rng, 8, 2)
        assert store.flush(TIMEOUT)
        assert ssd.used == 32 and len(list(ssd_dir.glob("slab-*.tpd"))) == 4
        load_back(store, kv, saved[-16:], "the newest prompts, in 4 slabs")
        store.close()


# --- 4. a damaged block falls through to the next tier that holds it -------------------------


def damage_on_disk(disk: DiskPool, key: bytes) -> None:
    """Flips the first 64 payload bytes of ``key``'s slot in its slab file."""
    slab, within = divmod(disk._index[key], disk.slab_slots)
    path = disk.directory / f"slab-{slab:06d}.tpd"
    offset = HEADER_BYTES + within * disk.layout.slot_bytes
    fd = os.open(path, os.O_RDWR)
    try:
        data = bytearray(os.pread(fd, 64, offset))
        os.pwrite(fd, bytes(b ^ 0xFF for b in data), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_a_block_damaged_on_disk_is_served_from_the_shared_fs(arrays, rng, stores, tmp_path):
    """Block 1 of 4 fails its checksum on disk; the shared filesystem holds it intact. Before:
    the load ended at block 1. Now it is read from the shared filesystem: all 4 load."""
    kv = Kv(arrays, rng)
    store = stores(config(8, disk=(tmp_path / "disk", 64), shared=tmp_path / "shared"), kv.pools)
    tokens = prompt(rng, 4)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    keys = keys_of(store, tokens)
    assert store.evict(tokens, tier="dram") == 4
    disk, shared = tier(store, "disk"), tier(store, "shared_fs")
    assert shared.contains(keys) == [True] * 4
    damage_on_disk(disk, keys[1])

    hit = store.lookup(tokens)
    assert hit.tiers == ("disk",) * 4
    result = store.load(hit, [20, 21, 22, 23])
    assert result.loaded_blocks == 4 and result.promoted_blocks == 4
    kv.check([20, 21, 22, 23], expected, "blocks from disk, block 1 from the shared filesystem")
    stats = store.stats()
    assert stats["tiers"]["disk"]["checksum_failures"] == 1
    assert stats["store"]["lower_tier_misses"] == 1  # counted as a miss of the disk tier
    assert stats["store"]["lower_tier_fallbacks"] == 1
    assert disk.contains(keys) == [True, False, True, True]  # the damaged copy is dropped


def test_a_block_damaged_in_dram_is_served_from_the_disk(arrays, rng, stores, tmp_path):
    """A DRAM block fails its checksum while the disk tier holds it intact: the load reads it
    from disk instead of ending there."""
    kv = Kv(arrays, rng)
    store = stores(config(8, disk=(tmp_path / "disk", 64)), kv.pools)
    tokens = prompt(rng, 4)
    expected = kv.blocks([0, 1, 2, 3])
    store.save(tokens, [0, 1, 2, 3])
    assert store.flush(TIMEOUT)
    keys = keys_of(store, tokens)
    with store.dram.slot_memory(store.dram.slot_of(keys[2])) as memory:
        memory[0] ^= 0xFF

    hit = store.lookup(tokens)
    assert hit.tiers == ("dram",) * 4
    result = store.load(hit, [20, 21, 22, 23])
    assert result.loaded_blocks == 4 and result.promoted_blocks == 1
    kv.check([20, 21, 22, 23], expected, "blocks from DRAM, block 2 from disk")
    assert store.stats()["tiers"]["dram"]["checksum_failures"] == 1
