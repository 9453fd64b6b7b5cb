"""KVCacheStore.load_by_layer: a load that fills the device pools one after another (an
engine's layers), each readable as soon as it is written; checksums compared at the end.

Real DRAM, disk and DevicePools of random bits (the KV store tests' helpers). One test reaches
into the DRAM tier (``store.dram.get_to_device_checked``, what the load runs) to look at the device
pools from inside the copy, between one pool and the next; it says so."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from test_kv_store import BS, N_POOLS, TIMEOUT, Kv, keys_of, make_config, prompt

from tpusync.errors import BlockIndexError, InvalidArgumentError
from tpusync.kv import LayerLoad, LoadResult


def saved(store: Any, kv: Kv, rng: np.random.Generator, blocks: int) -> tuple[list[int], list]:
    tokens = prompt(rng, blocks * BS + 3)
    ids = list(range(blocks))
    expected = kv.blocks(ids)
    store.save(tokens, ids)
    return tokens, expected


@pytest.mark.parametrize("path", ["auto", "jax"])
def test_each_pool_is_readable_once_waited_for(arrays, rng, stores, path):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16, path=path), kv.pools)
    tokens, expected = saved(store, kv, rng, 6)
    before = kv.snapshot()
    target = [40, 41, 42, 43, 44, 45]
    load = store.load_by_layer(store.lookup(tokens), target)
    assert isinstance(load, LayerLoad)
    for i in range(N_POOLS):
        assert load.wait_for(i, TIMEOUT)
        # pool i holds its blocks now, whatever the later pools' state
        now = arrays.bits(kv.pools[i].array)
        arrays.assert_same(now[target], expected[i], f"pool {i}")
    result = load.result(TIMEOUT)
    assert isinstance(result, LoadResult)
    assert (result.loaded_blocks, result.requested_blocks, result.loaded_tokens) == (6, 6, 6 * BS)
    assert load.done()
    kv.check(target, expected, before)
    assert kv.held() == [[]] * N_POOLS
    stats = store.stats()["store"]
    assert (stats["loads"], stats["loaded_blocks"], stats["open_handles"]) == (1, 6, 0)
    assert store.evict(tokens) == 6  # nothing left pinned


def test_pools_are_written_in_order_one_at_a_time(arrays, rng, stores):
    """Looks from inside the copy (reaching into the DRAM tier: the call the load makes, with
    its per-pool callback): when pool i is reported, pools 0..i hold the loaded blocks and the
    later pools still hold what they held."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens, expected = saved(store, kv, rng, 4)
    before = kv.snapshot()
    target = np.array([50, 51, 52, 53], np.int64)
    seen: list[int] = []

    def reported(i: int) -> None:
        seen.append(i)
        for j, pool in enumerate(kv.pools):
            now = arrays.bits(pool.array)[target]
            wanted = expected[j] if j <= i else before[j][target]
            arrays.assert_same(now, wanted, f"pool {j} when pool {i} was reported")

    keys = keys_of(store, tokens)[:4]
    store.dram.get_to_device_checked(keys, store.pools, target, "auto", reported)
    assert seen == list(range(N_POOLS))


def test_a_corrupt_block_is_not_loaded_and_not_read_again_from_disk(arrays, rng, stores, tmp_path):
    """Its bytes were readable before the checksum was compared, so the block is reported as not
    loaded (the engine recomputes it) even though the disk holds a good copy; a plain load of
    the same blocks reads it from disk."""
    kv = Kv(arrays, rng)
    store = stores(make_config(tmp_path, 8, disk=16), kv.pools)
    tokens, expected = saved(store, kv, rng, 4)
    assert store.flush(TIMEOUT)
    slot = store.dram.slot_of(keys_of(store, tokens)[2])
    with store.dram.slot_memory(slot) as memory:
        memory[321] ^= 0x5A
    load = store.load_by_layer(store.lookup(tokens), [20, 21, 22, 23])
    result = load.result(TIMEOUT)
    assert (result.loaded_blocks, result.requested_blocks) == (2, 4)
    assert all(load.wait_for(i, 0) for i in range(N_POOLS))
    assert store.stats()["tiers"]["dram"]["checksum_failures"] == 1
    assert store.stats()["store"]["load_misses"] == 2
    # DRAM dropped the corrupt block; the disk's copy serves a plain load
    plain = store.load(store.lookup(tokens), [30, 31, 32, 33])
    assert plain.loaded_blocks == 4
    kv.check([30, 31, 32, 33], expected)
    assert kv.held() == [[]] * N_POOLS


def test_a_failing_load_ends_every_wait_and_keeps_the_handle(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens, _ = saved(store, kv, rng, 3)
    for bad in ([1, 1, 2], [1, 2, 999]):  # a block id twice, one out of range
        hit = store.lookup(tokens)
        load = store.load_by_layer(hit, bad)
        assert load.wait_for(N_POOLS - 1, TIMEOUT)
        with pytest.raises(BlockIndexError, match="device_block_ids"):
            load.result(TIMEOUT)
        assert hit.open  # a failed load leaves the handle and its pins, as load() does
        store.release(hit)
    assert store.stats()["store"]["open_handles"] == 0


def test_a_pool_index_out_of_range_is_refused(arrays, rng, stores):
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 16), kv.pools)
    tokens, _ = saved(store, kv, rng, 2)
    load = store.load_by_layer(store.lookup(tokens), [5, 6])
    for bad in (-1, N_POOLS):
        with pytest.raises(InvalidArgumentError, match="pool_index"):
            load.wait_for(bad)
    assert load.result(TIMEOUT).loaded_blocks == 2


def test_loads_of_many_requests_in_many_threads(arrays, rng, stores):
    """Several layer loads at once (one per request of a step), each waited for pool by pool
    from its own thread: every block lands, nothing stays pinned."""
    kv = Kv(arrays, rng)
    store = stores(make_config(None, 32), kv.pools)
    prompts = []
    for _ in range(4):
        prompts.append(saved(store, kv, rng, 3))
        kv.write(range(3))  # the next prompt's blocks differ
    loads = [
        store.load_by_layer(store.lookup(tokens), [10 + 3 * n, 11 + 3 * n, 12 + 3 * n])
        for n, (tokens, _) in enumerate(prompts)
    ]
    failures: list[BaseException] = []

    def wait(load: LayerLoad) -> None:
        try:
            for i in range(N_POOLS):
                assert load.wait_for(i, TIMEOUT)
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=wait, args=(load,)) for load in loads]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert not failures
    for n, ((_, expected), load) in enumerate(zip(prompts, loads, strict=True)):
        assert load.result(TIMEOUT).loaded_blocks == 3
        kv.check([10 + 3 * n, 11 + 3 * n, 12 + 3 * n], expected)
    assert kv.held() == [[]] * N_POOLS
