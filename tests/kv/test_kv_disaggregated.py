"""Disaggregated prefill -> decode: a decode process reads the prefill process's KV over TCP.

The prefill side (this process) runs the model cold on a prompt, saves its KV into its store,
and serves its DRAM tier with a ``BlockServer``. A decode process (a real child) whose store
reads that tier through a ``RemotePool`` looks the prompt up, pulls the prefix over an
authenticated TCP connection into its own DRAM tier and device pool, and decodes: its greedy
tokens and first-token logits equal the prefill side's cold run with the same chunk boundary.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import kv_child
import numpy as np
import pytest

from tpusync._src.cluster import serving
from tpusync._src.testing.engine import ToyEngine
from tpusync._src.testing.model import ModelConfig, init_params
from tpusync.cluster import BlockServer, MemoryRegistry, NodeInfo, RegistryServer

CFG = ModelConfig(**kv_child.MODEL)


@pytest.fixture(scope="module")
def params() -> Any:
    return init_params(CFG)


@pytest.mark.parametrize("prompt_len", [64, 77])
def test_decode_process_pulls_the_prefix_over_tcp_and_matches(
    tmp_path: Path, params: Any, rng: np.random.Generator, prompt_len: int
) -> None:
    model_id = "toy-disaggregated"
    prefill = ToyEngine(
        CFG,
        kv_child.store_config({"model_id": model_id, "dram": {"capacity_blocks": 32}}),
        params=params,
    )
    secret = secrets.token_bytes(32)
    try:
        prompt = rng.integers(0, CFG.vocab_size, prompt_len).astype(np.int32)
        # the warm run loads the full blocks and prefills from there (the last token at least):
        # the cold reference splits its prefill at the same place
        boundary = min(prompt_len // CFG.block_size * CFG.block_size, prompt_len - 1)
        cold = prefill.generate(prompt, 4, use_cache=False, save=True, boundary=boundary)
        prefill.wait_saves()
        with BlockServer(prefill.store.dram, secret=secret) as server:
            spec = {
                "model": kv_child.MODEL,
                "store": {
                    "model_id": model_id,
                    "dram": {"capacity_blocks": 32},
                    "remote": {"address": server.address, "secret_hex": secret.hex()},
                },
                "ops": [["generate", {"prompt": prompt.tolist(), "n_new": 4, "save": False}]],
                "jax_cache": str(kv_child.jax_cache_dir(tmp_path)),
            }
            (decode,) = kv_child.run(spec, tmp_path)
            served = server.leases.expired, server.rejected
    finally:
        prefill.close()
    full = prompt_len // CFG.block_size
    assert decode["lookup_tiers"] == ["remote"] * full  # every full block came over TCP
    assert decode["cached_tokens"] == boundary
    assert decode["tokens"] == cold.tokens.tolist()
    assert decode["logits"] == kv_child.logits_hex(cold.prefill_logits)
    assert served == (0, 0)  # no lease ran out, no peer was refused


def test_a_decode_process_with_the_wrong_secret_gets_nothing(
    tmp_path: Path, params: Any, rng: np.random.Generator
) -> None:
    prefill = ToyEngine(
        CFG,
        kv_child.store_config({"model_id": "toy-dis-2", "dram": {"capacity_blocks": 16}}),
        params=params,
    )
    try:
        prefill.generate(rng.integers(0, CFG.vocab_size, 48), 1, use_cache=False)
        prefill.wait_saves()
        with BlockServer(prefill.store.dram, secret=secrets.token_bytes(32)) as server:
            spec = {
                "model": kv_child.MODEL,
                "store": {
                    "model_id": "toy-dis-2",
                    "dram": {"capacity_blocks": 16},
                    "remote": {"address": server.address, "secret_hex": "ab" * 32},
                },
                "ops": [],
                "jax_cache": str(kv_child.jax_cache_dir(tmp_path)),
            }
            with pytest.raises(AssertionError, match="AuthenticationError"):
                kv_child.run(spec, tmp_path)
            assert server.rejected >= 1
    finally:
        prefill.close()


def test_tier_specs_are_checked() -> None:
    from tpusync.errors import InvalidArgumentError
    from tpusync.kv import DramTier, ExistingTier, KVStoreConfig

    # tier specs (or ExistingTier for a tier one opened), never a bare tier
    with pytest.raises(InvalidArgumentError, match=r"tiers\[0\]: expected a tier spec"):
        KVStoreConfig("m", 16, DramTier(4), tiers=(object(),))
    with pytest.raises(InvalidArgumentError, match=r"ExistingTier: expected a name and a Lower"):
        ExistingTier("remote", object())


def test_decode_process_given_only_the_registry_address(
    tmp_path: Path, params: Any, rng: np.random.Generator
) -> None:
    """The prefill store publishes its DRAM keys to a registry served over TCP; a decode child
    that knows only the registry's address finds the holder, pulls the prefix and matches the
    cold run. After the prefill side evicts the prefix from DRAM, the registry no longer lists
    it and the decode side misses (recomputes) instead of pulling."""
    secret = secrets.token_bytes(32)
    registry = MemoryRegistry()
    prefill = ToyEngine(
        CFG,
        kv_child.store_config({"model_id": "toy-dis-3", "dram": {"capacity_blocks": 32}}),
        params=params,
    )
    prompt = rng.integers(0, CFG.vocab_size, 80).astype(np.int32)
    try:
        with (
            RegistryServer(registry, secret=secret) as registry_server,
            BlockServer(prefill.store.dram, secret=secret) as blocks,
        ):
            serving.publish_to(
                prefill.store, registry, NodeInfo("prefill", addresses=(blocks.address,)), ttl_s=5.0
            )
            cold = prefill.generate(prompt, 3, use_cache=False, save=True, boundary=79)
            prefill.wait_saves()
            assert prefill.store.flush(30)
            assert all(registry.holders(prefill.store._keys(prompt, None)[1]))

            def decode() -> dict[str, Any]:
                spec = {
                    "model": kv_child.MODEL,
                    "store": {
                        "model_id": "toy-dis-3",
                        "dram": {"capacity_blocks": 32},
                        "cluster": {
                            "registry": registry_server.address,
                            "secret_hex": secret.hex(),
                        },
                    },
                    "ops": [["generate", {"prompt": prompt.tolist(), "n_new": 3, "save": False}]],
                    "jax_cache": str(kv_child.jax_cache_dir(tmp_path)),
                }
                (result,) = kv_child.run(spec, tmp_path)
                return result

            warm = decode()
            assert warm["lookup_tiers"] == ["cluster"] * 5
            assert warm["cached_tokens"] == 79
            assert warm["tokens"] == cold.tokens.tolist()
            assert warm["logits"] == kv_child.logits_hex(cold.prefill_logits)

            assert prefill.store.evict(prompt, tier="dram") == 5  # no lower tier: dropped
            assert prefill.store.flush(30)
            assert not any(registry.holders(prefill.store._keys(prompt, None)[1]))
            missed = decode()
            assert missed["lookup_tiers"] == [] and missed["cached_tokens"] == 0
            assert missed["tokens"] == cold.tokens.tolist()  # recomputed, same answer
    finally:
        prefill.close()
    assert registry.nodes() == []  # close() unregistered the node


def test_tensor_parallel_shards_agree_through_the_registry(rng: np.random.Generator) -> None:
    """Two shards of one model (shard_rank 0 and 1, each its own store with its own keys)
    publish to one registry: a prefix counts only as far as every shard holds it."""
    import jax.numpy as jnp

    from tpusync import DevicePool
    from tpusync.kv import DramTier, KVCacheStore, KVStoreConfig

    registry = MemoryRegistry()
    stores = []
    for rank in range(2):
        pools = [
            DevicePool(jnp.asarray(rng.standard_normal((32, 16, 2, 8), dtype=np.float32)))
            for _ in range(2)
        ]
        config = KVStoreConfig("toy-tp", 16, DramTier(32), shard_rank=rank, shard_count=2)
        store = KVCacheStore(config, pools)
        serving.publish_to(
            store, registry, NodeInfo(f"tp-{rank}", group="tp", shard_rank=rank, shard_count=2)
        )
        stores.append(store)
    try:
        tokens = rng.integers(0, 1000, 4 * 16)
        stores[0].save(tokens, [0, 1, 2, 3])
        assert stores[0].flush(30)
        with stores[0].lookup(tokens) as hit:
            assert hit.num_blocks == 0  # shard 1 holds none of it yet
        stores[1].save(tokens[: 2 * 16], [5, 6])
        assert stores[1].flush(30)
        with stores[0].lookup(tokens) as hit:
            assert hit.num_blocks == 2  # both shards hold the first two blocks
        with stores[1].lookup(tokens) as hit:
            assert hit.num_blocks == 2  # shard 1 itself holds only two
        stores[1].save(tokens, [5, 6, 7, 8])
        assert stores[1].flush(30)
        with stores[0].lookup(tokens) as hit:
            assert hit.num_blocks == 4
    finally:
        for store in stores:
            store.close()
