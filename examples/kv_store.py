"""Prefix caching with tpusync.kv.KVCacheStore, on the small test model of tpusync.testing.

A paged-KV transformer (random weights, pure JAX) serves one random prompt three times through
the loop an engine runs per request: look the prompt up, load the cached prefix into the
request's device blocks, prefill the rest, save. The first request is cold; the second loads
its prefix from DRAM, the third (after the prefix is evicted from DRAM) from a local-disk tier.
The warm requests' logits must equal the cold one's bit for bit. Runs on the CPU backend in
well under a minute, removing its directories in /tmp and /dev/shm at the end:

    python examples/kv_store.py
"""

import logging
import secrets
import sys
import tempfile
from pathlib import Path

import numpy as np

import tpusync
from tpusync.kv import DiskTier, DramTier, KVCacheStore, KVStoreConfig, load_secret
from tpusync.testing import model

# max_chunk = block_size: a prefill runs one block at a time, so a warm request that starts at a
# block boundary computes the same floats in the same order as the cold one.
CONFIG = model.ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
    block_size=16, num_blocks=64, max_blocks_per_seq=16, max_chunk=16,
)  # fmt: skip


def serve(store, kv, params, prompt, block_table):
    """One request: returns the last prompt token's logits, how many tokens were loaded, and
    the tiers they came from."""
    hit = store.lookup(prompt)  # longest cached prefix, blocks pinned
    if hit.num_blocks:
        loaded = store.load(hit, block_table[: hit.num_blocks])  # consumes the handle
        start = min(loaded.loaded_tokens, len(prompt) - 1)  # recompute at least the last token
    else:
        store.release(hit)
        start = 0
    # ... prefill prompt[start:] (the model donates the pools: hand the new arrays back)
    logits, arrays = model.prefill(
        params, CONFIG, [pool.array for pool in kv], prompt[start:], block_table, start
    )
    for pool, array in zip(kv, arrays, strict=True):
        pool.update(array)
    # ... then save the prompt's full blocks
    save = store.save_async(prompt, block_table)
    save.released.result()  # the device blocks are the engine's again
    save.result()  # durable in DRAM; disk follows in the background
    return np.asarray(logits), start, "+".join(sorted(set(hit.tiers)))  # tiers: per block


def open_store(secret_file, work, shm):
    """The KV store over the engine's pools: DRAM in /dev/shm, a local-disk tier below it."""
    # The engine's KV pools, K and V per layer: (num_blocks, block_size, kv_heads, head_dim)
    kv = [tpusync.DevicePool(a, donated_steps=True) for a in model.init_kv_pools(CONFIG)]
    store = KVCacheStore(
        KVStoreConfig(
            model_id="tpusync-test-model",
            weight_version="step-0",
            block_size=CONFIG.block_size,  # tokens per block: the pools' own
            dram=DramTier(capacity_blocks=32, name="server-a", shm_dir=shm),  # survives restarts
            tiers=(DiskTier(Path(work) / "kv", capacity_blocks=128, create=True),),
            secret=load_secret(secret_file),  # keys every block hash
        ),
        kv,
    )
    store.warmup()  # at start-up: plans and compiles now, so the first load is as fast as the rest
    return kv, store


def main() -> int:
    logging.basicConfig(level=logging.WARNING)  # a tier the store passes over says why
    rng = np.random.default_rng()
    prompt = rng.integers(0, CONFIG.vocab_size, 100).astype(np.int32)  # 6 blocks + 4 tokens
    params = model.init_params(CONFIG)
    # work: the secret and the disk tier; shm: a private directory in /dev/shm for DRAM
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        secret_file = Path(work) / "secret"  # in a deployment: one file, given to every host
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        kv, store = open_store(secret_file, work, shm)
        with store:
            # three requests, each into other device blocks
            cold, _, _ = serve(store, kv, params, prompt, np.arange(0, 7))
            store.flush()  # the background write-back to disk has finished
            dram, from_dram, dram_tiers = serve(store, kv, params, prompt, np.arange(10, 17))
            store.evict(prompt, tier="dram")  # demoted: the disk tier holds them
            disk, from_disk, disk_tiers = serve(store, kv, params, prompt, np.arange(20, 27))

    print(f"cold: prefilled {len(prompt)} tokens")
    for tiers, loaded in ((dram_tiers, from_dram), (disk_tiers, from_disk)):
        print(f"warm from {tiers}: loaded {loaded} tokens, prefilled the last 4")
    ok = (dram_tiers, disk_tiers) == ("dram", "disk") and from_dram == from_disk == 96
    ok = ok and cold.tobytes() == dram.tobytes() == disk.tobytes()
    print("outputs equal" if ok else "MISMATCH: a warm request differs from the cold one")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
