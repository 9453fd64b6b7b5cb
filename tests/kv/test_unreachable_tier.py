"""A lower tier that cannot be reached rests: a stopped store node (SIGSTOP: it accepts and never
answers) costs the KV store one timeout, not one per save; saves that must evict from a full
DRAM go on at DRAM speed, and once the node answers again its blocks are found and loaded bit
for bit."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from test_kv_tier_failures import BS, Kv, counters, prompt

import tpusync.cluster  # noqa: F401  (registers the store_node section)
from tpusync._src.kv._tier_faults import REST_FIRST_S, TierFaults
from tpusync._src.testing.processes import start_store_node, stop_process
from tpusync.kv import KVStoreConfig

NODE_TIMEOUT_S = 1.0
DRAM_BLOCKS = 4


def test_a_stopped_store_node_costs_one_timeout_not_one_per_save(arrays, rng, stores, tmp_path):
    kv = Kv(arrays, rng)
    secret = os.urandom(32)
    node, ready = start_store_node(tmp_path, secret, 32 << 20)
    try:
        config = KVStoreConfig.from_dict(
            {
                "model_id": "test-model",
                "block_size": BS,
                "dram": {"capacity_blocks": DRAM_BLOCKS},
                "store_node": {"address": ready["address"], "timeout_s": NODE_TIMEOUT_S},
                "secret_file": str(tmp_path / "secret"),
            }
        )
        store = stores(config, kv.pools)
        kept = []  # written back to the node, then evicted from DRAM while it is stopped
        for _ in range(DRAM_BLOCKS):
            kv.refill()
            tokens = prompt(rng, 1)
            assert store.save(tokens, [0]).stored_blocks == 1
            kept.append((tokens, kv.blocks([0])))
        assert store.flush(10)
        os.kill(node.pid, signal.SIGSTOP)
        try:
            took = []
            for _ in range(12):  # each needs a DRAM slot: evicts one block the node holds
                kv.refill()
                started = time.monotonic()
                assert store.save(prompt(rng, 1), [0]).stored_blocks == 1
                took.append(time.monotonic() - started)
            # Before the rest, each of these saves waited out the node's timeout two or three
            # times (its lookup, the demotion, the write-back); now one of them waits (the first
            # to reach the node: not always the first save, whose eviction may reach none).
            assert sum(took) < 2 * NODE_TIMEOUT_S + 1.5, took
            assert sum(t >= NODE_TIMEOUT_S / 2 for t in took) <= 1, took
            stats = counters(store)
            assert stats["lower_tier_rested"] > 0 and stats["evicted_unsaved"] > 0, stats
            assert all(store.lookup(tokens).num_blocks == 0 for tokens, _ in kept)  # a miss
        finally:
            os.kill(node.pid, signal.SIGCONT)
        # Answering again: a lookup after the rest asks the node, and finds the blocks it holds.
        deadline = time.monotonic() + 30
        tokens, expected = kept[0]
        while (hit := store.lookup(tokens)).num_blocks == 0:
            store.release(hit)
            assert time.monotonic() < deadline, "the node was not asked again"
            time.sleep(0.2)
        assert hit.tiers == ("node",)
        assert store.load(hit, [5]).loaded_blocks == 1
        kv.check([5], expected, "a block from the node after its rest")
        # And saves demote into it again.
        evicted_unsaved = counters(store)["evicted_unsaved"]
        for _ in range(DRAM_BLOCKS + 1):
            kv.refill()
            assert store.save(prompt(rng, 1), [0]).stored_blocks == 1
        assert counters(store)["evicted_unsaved"] == evicted_unsaved
        store.close()
    finally:
        assert stop_process(node) == 0


def test_rests_double_up_to_a_limit_and_end_when_the_tier_answers() -> None:
    faults = TierFaults(["dram", "node"], [object(), object()])
    assert not faults.resting(1) and not faults.unreached(1)
    faults.failed(1, "a put", OSError("no space left"))  # a full disk is no reason to rest
    assert not faults.resting(1) and not faults.unreached(1)
    lengths = []
    for _ in range(10):
        faults.unreachable(1, TimeoutError("no answer"))
        lengths.append(faults._rest_s[1])
    assert lengths[:3] == [REST_FIRST_S, 2 * REST_FIRST_S, 4 * REST_FIRST_S]
    assert lengths[-1] == 60.0
    assert faults.resting(1) and faults.unreached(1) and not faults.resting(0)
    faults.reached(1)
    assert not faults.resting(1) and not faults.unreached(1)
    faults.failed(1, "a put", ConnectionRefusedError("refused"))
    assert faults.resting(1)
    faults.worked(1)
    assert not faults.resting(1) and faults.failures() == {"node": 2}


def test_a_node_gone_for_good_is_a_miss_within_one_timeout(arrays, rng, stores, tmp_path: Path):
    """Killed (SIGKILL): connections are refused at once, and the store keeps serving DRAM."""
    kv = Kv(arrays, rng)
    node, ready = start_store_node(tmp_path, os.urandom(32), 32 << 20)
    config = KVStoreConfig.from_dict(
        {
            "model_id": "test-model",
            "block_size": BS,
            "dram": {"capacity_blocks": DRAM_BLOCKS},
            "store_node": {"address": ready["address"], "timeout_s": NODE_TIMEOUT_S},
            "secret_file": str(tmp_path / "secret"),
        }
    )
    store = stores(config, kv.pools)
    node.kill()
    assert stop_process(node) == -signal.SIGKILL
    started = time.monotonic()
    saved = []
    for _ in range(3 * DRAM_BLOCKS):
        kv.refill()
        tokens = prompt(rng, 1)
        assert store.save(tokens, [0]).stored_blocks == 1
        saved.append((tokens, kv.blocks([0])))
    assert time.monotonic() - started < 2 * NODE_TIMEOUT_S + 1.5
    tokens, expected = saved[-1]
    hit = store.lookup(tokens)
    assert hit.tiers == ("dram",)
    assert store.load(hit, [7]).loaded_blocks == 1
    kv.check([7], expected, "the newest block, from DRAM")
    store.close()
