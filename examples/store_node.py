"""A store node: `tpusync serve` lends a host's DRAM to the KV stores of other hosts.

Starts `tpusync serve` as a child process (hosting a registry too), then two KV stores on the
small test model of tpusync.testing, each with the node as a lower tier (StoreNodeTier): the
first prefills a random prompt and its save is written through to the node; the second, a
fresh store with empty DRAM (another host, or a restarted server), loads the prefix from the
node and prefills only the tail. Its logits must equal the first store's bit for bit.
The node is stopped by its pid at the end. Runs on the CPU backend in well under a minute:

    python examples/store_node.py
"""

import json
import logging
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import tpusync
from tpusync.cluster import StoreNodeTier
from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig, load_secret
from tpusync.testing import model

# max_chunk = block_size: a prefill runs one block at a time, so a warm request that starts at a
# block boundary computes the same floats in the same order as the cold one.
CONFIG = model.ModelConfig(
    vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128,
    block_size=16, num_blocks=64, max_blocks_per_seq=16, max_chunk=16,
)  # fmt: skip
PARAMS = model.init_params(CONFIG)


def start_store_node(secret_file):
    """`tpusync serve` in a child process; returns it and its addresses, once it listens."""
    command = [
        sys.executable, "-m", "tpusync", "serve",  # the `tpusync serve` command
        "--dram", "64MiB", "--secret-file", str(secret_file),
        "--host", "127.0.0.1", "--port", "0",  # off loopback: --tls-cert/--tls-key (or --insecure)
        "--registry-port", "0", "--ready-json",  # host a registry; print the addresses as JSON
    ]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the node needs no accelerator
    node = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    line = node.stdout.readline()  # the ready line, or "" if it exited
    if not line:
        stop(node)
        raise RuntimeError(f"tpusync serve exited with {node.returncode}")
    return node, json.loads(line)  # {"address": "host:port", "registry": "host:port"}


def stop(node):
    """SIGTERM (the node unregisters and exits 0), then SIGKILL if it hangs."""
    node.terminate()
    try:
        return node.wait(timeout=10)
    except subprocess.TimeoutExpired:
        node.kill()
        return node.wait(timeout=10)
    finally:
        node.stdout.close()


def serve_once(address, secret, prompt):
    """A KV store whose lower tier is the node serves one request: the last token's logits,
    the tokens loaded and the tiers they came from."""
    kv = [tpusync.DevicePool(a, donated_steps=True) for a in model.init_kv_pools(CONFIG)]
    node_tier = StoreNodeTier(address)  # secret: the store's; tls= off loopback
    config = KVStoreConfig(
        model_id="tpusync-test-model",
        block_size=CONFIG.block_size,
        dram=DramTier(capacity_blocks=32),
        tiers=(node_tier,),  # written through, demoted to, read
        secret=secret,
    )
    table = np.arange(7, dtype=np.int32)  # the request's device blocks: 6 full ones + 4 tokens
    with KVCacheStore(config, kv) as store:
        hit = store.lookup(prompt)
        if hit.num_blocks:
            start = min(store.load(hit, table[: hit.num_blocks]).loaded_tokens, len(prompt) - 1)
        else:
            store.release(hit)
            start = 0
        logits, arrays = model.prefill(
            PARAMS, CONFIG, [pool.array for pool in kv], prompt[start:], table, start
        )
        for pool, array in zip(kv, arrays, strict=True):
            pool.update(array)
        store.save(prompt, table)
        store.flush()  # written through to the node
    return np.asarray(logits), start, "+".join(sorted(set(hit.tiers)))


def main() -> int:
    logging.basicConfig(level=logging.WARNING)  # a tier the store passes over says why
    prompt = np.random.default_rng().integers(0, CONFIG.vocab_size, 100).astype(np.int32)
    with tempfile.TemporaryDirectory() as work:
        secret_file = Path(work) / "secret"  # in a deployment: one file, given to every host
        secret_file.write_text(secrets.token_hex(32))
        secret_file.chmod(0o600)
        secret = load_secret(secret_file)  # what the node read from the same file

        node, addresses = start_store_node(secret_file)
        try:
            print(f"store node at {addresses['address']}, registry at {addresses['registry']}")
            cold, _, _ = serve_once(addresses["address"], secret, prompt)
            warm, loaded, tiers = serve_once(addresses["address"], secret, prompt)
        finally:
            code = stop(node)

    print(f"second store: loaded {loaded} tokens from the {tiers!r} tier; node exited {code}")
    ok = tiers == "node" and loaded == 96 and code == 0 and warm.tobytes() == cold.tobytes()
    print("outputs equal" if ok else "MISMATCH: the store node's blocks gave another output")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
