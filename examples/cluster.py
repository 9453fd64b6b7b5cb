"""Disaggregated prefill -> decode across hosts: a registry, a prefill node, a decode node.

Three roles that would each run on their own host, here in one process over loopback TCP:

* the registry: a MemoryRegistry served by a RegistryServer (`tpusync serve --registry-port`
  hosts one too; see examples/store_node.py);
* the prefill node: prefills a random prompt on the small test model of tpusync.testing, saves
  its KV, serves its store's blocks and lists them in the registry (tpusync.cluster.serve);
* the decode node: given only the registry's address, finds the prefix there, pulls its blocks
  over the authenticated data plane into its own device pools and prefills only the tail.

The decode node's logits must equal the prefill node's bit for bit. All of them share the
deployment secret, read from one file with tpusync.kv.load_secret. Runs on the CPU backend in
well under a minute, leaving nothing behind:

    python examples/cluster.py
"""

import logging
import secrets
import sys
import tempfile
from pathlib import Path

import numpy as np

import tpusync
from tpusync import cluster
from tpusync.cluster import MemoryRegistry, RegistryServer, RegistryTier, RemoteRegistry
from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig, load_secret
from tpusync.testing import model

# max_chunk = block_size: a prefill runs one block at a time, so the decode node, which starts
# at a block boundary, computes the same floats in the same order as the prefill node.
CONFIG = model.ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
    block_size=16, num_blocks=64, max_blocks_per_seq=16, max_chunk=16,
)  # fmt: skip
PARAMS = model.init_params(CONFIG)  # the same weights on every node


def open_store(secret, tiers=()):
    """A node's device KV pools and its KV store over them."""
    kv = [tpusync.DevicePool(a, donated_steps=True) for a in model.init_kv_pools(CONFIG)]
    config = KVStoreConfig(
        model_id="tpusync-test-model",
        block_size=CONFIG.block_size,
        dram=DramTier(capacity_blocks=32),
        tiers=tiers,
        secret=secret,
    )
    return kv, KVCacheStore(config, kv)


def serve(store, kv, prompt, block_table):
    """One request (see examples/kv_store.py): the last token's logits, tokens loaded, tiers."""
    hit = store.lookup(prompt)
    if hit.num_blocks:
        start = min(store.load(hit, block_table[: hit.num_blocks]).loaded_tokens, len(prompt) - 1)
    else:
        store.release(hit)
        start = 0
    logits, arrays = model.prefill(
        PARAMS, CONFIG, [pool.array for pool in kv], prompt[start:], block_table, start
    )
    for pool, array in zip(kv, arrays, strict=True):
        pool.update(array)
    store.save(prompt, block_table)
    return np.asarray(logits), start, "+".join(sorted(set(hit.tiers)))


def prefill_node(registry_address, secret, prompt, table):
    """Prefills ``prompt`` and serves its KV (while the returned store is open)."""
    kv, store = open_store(secret)
    # serve the store's blocks (DRAM, and disk moved up on demand) and list them in the registry
    registry = RemoteRegistry(registry_address, secret=secret)  # tls= off loopback
    cluster.serve(store, registry, "prefill-0", secret=secret)  # host=, tls= off loopback
    logits, _, _ = serve(store, kv, prompt, table)
    store.flush()  # saved, and published to the registry
    return store, registry, logits


def decode_node(registry_address, secret, prompt, table):
    """Serves ``prompt`` with whatever the nodes listed in the registry hold."""
    # read whatever live nodes hold, as a read-only tier below its own DRAM
    cluster = RegistryTier(address=registry_address, exclude="decode-0")  # the store's secret
    kv, store = open_store(secret, tiers=(cluster,))  # the store opens it with its own layout
    with store:
        return serve(store, kv, prompt, table)


def main() -> int:
    logging.basicConfig(level=logging.WARNING)  # a tier the store passes over says why
    prompt = np.random.default_rng().integers(0, CONFIG.vocab_size, 100).astype(np.int32)
    table = np.arange(7, dtype=np.int32)  # the request's device blocks: 6 full ones + 4 tokens
    with tempfile.TemporaryDirectory() as work:
        secret_file = Path(work) / "secret"  # in a deployment: one file, given to every host
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        secret = load_secret(secret_file)

        with RegistryServer(MemoryRegistry(), secret=secret) as registry_server:  # host=, tls=
            address = registry_server.address  # "host:port": all the other nodes need
            prefill_store, registry, prefilled = prefill_node(address, secret, prompt, table)
            with registry, prefill_store:  # closing the store stops its server, unregisters
                decoded, loaded, tiers = decode_node(address, secret, prompt, table)

    print(f"decode node: loaded {loaded} tokens from the {tiers!r} tier, prefilled the rest")
    ok = tiers == "cluster" and loaded == 96 and decoded.tobytes() == prefilled.tobytes()
    print("outputs equal" if ok else "MISMATCH: the decode node's output differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
