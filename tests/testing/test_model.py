"""The JAX test model (tpusync.testing.model): shapes, determinism, chunked prefill, KV reuse
across block tables, decode, padding buckets and bad input."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from tpusync._src.testing.model import (
    ModelConfig,
    blocks_needed,
    decode_step,
    generate_greedy,
    init_kv_pools,
    init_params,
    prefill,
)

CFG = ModelConfig(num_blocks=160, max_blocks_per_seq=64, max_chunk=256)
BS = CFG.block_size


@pytest.fixture(scope="module")
def params():
    return init_params(CFG)


def _tokens(n: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, n).astype(np.int32)


def _table(n_blocks: int, first: int = 0, seed: int | None = None) -> np.ndarray:
    ids = np.arange(first, first + n_blocks)
    if seed is not None:
        ids = np.random.default_rng(seed).permutation(CFG.num_blocks)[:n_blocks]
    return ids.astype(np.int32)


def _chunked(params, pools, toks, table, bounds):
    logits = None
    for s, e in itertools.pairwise(bounds):
        logits, pools = prefill(params, CFG, pools, toks[s:e], table, s)
    return np.asarray(logits), pools


def test_shapes(params):
    assert params["embed"].shape == (CFG.vocab_size, CFG.d_model)
    assert len(params["layers"]) == CFG.n_layers
    assert params["layers"][0]["wk"].shape == (CFG.d_model, CFG.n_kv_heads * CFG.head_dim)
    pools = init_kv_pools(CFG)
    assert len(pools) == 2 * CFG.n_layers
    assert all(p.shape == (CFG.num_blocks, BS, CFG.n_kv_heads, CFG.head_dim) for p in pools)
    assert all(p.dtype == jnp.float32 for p in pools)
    toks = _tokens(40)
    logits, pools = prefill(params, CFG, pools, toks, _table(3))
    assert logits.shape == (CFG.vocab_size,) and logits.dtype == jnp.float32
    assert bool(jnp.isfinite(logits).all())
    assert 0.1 < float(logits.std()) < 100.0
    assert len(pools) == 2 * CFG.n_layers
    # The chunk's KV landed in blocks 0..2 (40 tokens: slots 0..7 of block 2), nothing else.
    k0 = np.asarray(pools[0])
    assert all(np.abs(k0[b, s]).max() > 0 for b in range(2) for s in range(BS))
    assert np.abs(k0[2, :8]).max() > 0
    assert not k0[2, 8:].any() and not k0[3:].any()
    # Same weights from the same seed.
    again = init_params(CFG)
    np.testing.assert_array_equal(np.asarray(again["lm_head"]), np.asarray(params["lm_head"]))


def test_deterministic_same_chunking(params):
    toks = _tokens(300)
    table = _table(blocks_needed(CFG, 300))
    a, pools_a = _chunked(params, init_kv_pools(CFG), toks, table, [0, 136, 300])
    b, pools_b = _chunked(params, init_kv_pools(CFG), toks, table, [0, 136, 300])
    np.testing.assert_array_equal(a, b)
    for pa, pb in zip(pools_a, pools_b, strict=True):
        np.testing.assert_array_equal(np.asarray(pa), np.asarray(pb))


def test_chunked_matches_one_shot(params):
    # Different chunkings change matmul shapes (so summation order), hence float32 tolerance.
    toks = _tokens(250)
    table = _table(blocks_needed(CFG, 250))
    one, _ = _chunked(params, init_kv_pools(CFG), toks, table, [0, 250])
    three, _ = _chunked(params, init_kv_pools(CFG), toks, table, [0, 37, 160, 250])
    np.testing.assert_allclose(three, one, rtol=1e-5, atol=1e-5)
    assert int(np.argmax(three)) == int(np.argmax(one))


def test_kv_reuse_across_block_tables(params):
    n, a = 300, 200  # a is not a block boundary: the partial block is copied too
    toks = _tokens(n, seed=3)
    nb = blocks_needed(CFG, n + 8)  # room for the generated tokens below
    table_a = _table(nb)
    table_b = _table(nb, seed=7)
    assert set(table_a[: blocks_needed(CFG, a)]) != set(table_b[: blocks_needed(CFG, a)])

    # Reference: prefix [0:a) then continuation [a:n) in the same pools through table_a.
    _, pools = prefill(params, CFG, init_kv_pools(CFG), toks[:a], table_a, 0)
    prefix_pools = [np.asarray(p) for p in pools]
    ref, _ = prefill(params, CFG, pools, toks[a:], table_a, a)

    # Copy the prefix's blocks to other ids of fresh pools whose other slots are NaN garbage.
    k = blocks_needed(CFG, a)
    moved = []
    for p in prefix_pools:
        dst = jnp.full(CFG.kv_pool_shape, jnp.nan, jnp.float32)
        moved.append(dst.at[jnp.asarray(table_b[:k])].set(jnp.asarray(p)[jnp.asarray(table_a[:k])]))
    warm, _ = prefill(params, CFG, moved, toks[a:], table_b, a)
    np.testing.assert_array_equal(np.asarray(warm), np.asarray(ref))

    # The same through generate_greedy: cold with the boundary at a, warm from the copied prefix.
    cold = generate_greedy(params, CFG, init_kv_pools(CFG), toks, table_a, 6, chunk=a)
    moved2 = []
    for p in prefix_pools:
        dst = jnp.zeros(CFG.kv_pool_shape, jnp.float32)
        moved2.append(
            dst.at[jnp.asarray(table_b[:k])].set(jnp.asarray(p)[jnp.asarray(table_a[:k])])
        )
    hot = generate_greedy(params, CFG, moved2, toks, table_b, 6, chunk=a, cached_len=a)
    np.testing.assert_array_equal(hot.tokens, cold.tokens)
    np.testing.assert_array_equal(hot.prefill_logits, cold.prefill_logits)
    np.testing.assert_array_equal(cold.prefill_logits, np.asarray(ref))


def test_decode_matches_prefill_of_extended_sequence(params):
    n = 70
    toks = _tokens(n + 3, seed=5)
    table = _table(blocks_needed(CFG, n + 3))
    _, pools = prefill(params, CFG, init_kv_pools(CFG), toks[:n], table, 0)
    for i in range(3):
        dec, pools = decode_step(params, CFG, pools, int(toks[n + i]), table, n + i)
        full, _ = prefill(params, CFG, init_kv_pools(CFG), toks[: n + i + 1], table, 0)
        np.testing.assert_allclose(np.asarray(dec), np.asarray(full), rtol=1e-4, atol=1e-4)


def test_generate_greedy(params):
    toks = _tokens(50, seed=9)
    table = _table(blocks_needed(CFG, 50 + 8))
    g1 = generate_greedy(params, CFG, init_kv_pools(CFG), toks, table, 8, chunk=16)
    g2 = generate_greedy(params, CFG, init_kv_pools(CFG), toks, table, 8, chunk=16)
    assert g1.tokens.shape == (8,) and g1.tokens.dtype == np.int32
    assert ((g1.tokens >= 0) & (g1.tokens < CFG.vocab_size)).all()
    np.testing.assert_array_equal(g1.tokens, g2.tokens)
    assert int(np.argmax(g1.prefill_logits)) == int(g1.tokens[0])
    # Greedy is consistent with a one-shot prefill of the prompt plus the generated tokens.
    ext = np.concatenate([toks, g1.tokens[:-1]])
    logits, _ = prefill(params, CFG, init_kv_pools(CFG), ext, table, 0)
    assert int(np.argmax(np.asarray(logits))) == int(g1.tokens[-1])


def test_padding_bucket_does_not_change_results(params):
    toks = _tokens(20, seed=11)
    table = _table(2, first=5)
    plain, pools_plain = prefill(params, CFG, init_kv_pools(CFG), toks, table, 0)  # bucket 32
    padded, pools_padded = prefill(params, CFG, init_kv_pools(CFG), toks, table, 0, pad_to=128)
    np.testing.assert_allclose(np.asarray(padded), np.asarray(plain), rtol=1e-5, atol=1e-5)
    for pp, pq in zip(pools_plain, pools_padded, strict=True):
        pp, pq = np.asarray(pp), np.asarray(pq)
        np.testing.assert_allclose(pq, pp, rtol=1e-5, atol=1e-6)
        # Pads wrote nothing: only blocks 5 (full) and 6 (slots 0..3) hold data.
        rest = np.delete(pq, [5, 6], axis=0)
        assert not rest.any()
        assert not pq[6, 4:].any()


def test_bad_input(params):
    pools = init_kv_pools(CFG)
    ok = _tokens(20)
    table = _table(2)
    with pytest.raises(ValueError, match="tokens"):
        prefill(params, CFG, pools, np.array([1, CFG.vocab_size]), table)
    with pytest.raises(ValueError, match="tokens"):
        prefill(params, CFG, pools, np.array([-1, 2]), table)
    with pytest.raises(ValueError, match="tokens"):
        prefill(params, CFG, pools, np.array([1.0, 2.0]), table)
    with pytest.raises(ValueError, match="tokens"):
        prefill(params, CFG, pools, np.array([], np.int32), table)
    with pytest.raises(ValueError, match="block_table"):
        prefill(params, CFG, pools, ok, table[:1])
    with pytest.raises(ValueError, match="block_table"):
        prefill(params, CFG, pools, ok, np.array([0, CFG.num_blocks]))
    with pytest.raises(ValueError, match="block_table"):
        prefill(params, CFG, pools, ok, np.array([3, 3]))
    with pytest.raises(ValueError, match="block_table"):
        prefill(params, CFG, pools, ok, table, start_pos=BS)  # 36 tokens need 3 blocks
    with pytest.raises(ValueError, match="start_pos"):
        prefill(params, CFG, pools, ok, table, start_pos=-1)
    with pytest.raises(ValueError, match="max_blocks_per_seq"):
        prefill(params, CFG, pools, ok, np.arange(CFG.num_blocks), start_pos=CFG.max_seq_len)
    with pytest.raises(ValueError, match="kv_pools"):
        prefill(params, CFG, pools[:-1], ok, table)
    with pytest.raises(ValueError, match="kv_pools"):
        prefill(params, CFG, [p.astype(jnp.float16) for p in pools], ok, table)
    with pytest.raises(ValueError, match="pad_to"):
        prefill(params, CFG, pools, ok, table, pad_to=8)
    with pytest.raises(ValueError, match="token"):
        decode_step(params, CFG, pools, CFG.vocab_size, table, 3)
    with pytest.raises(ValueError, match="pos"):
        decode_step(params, CFG, pools, 1, table, -2)
    with pytest.raises(ValueError, match="cached_len"):
        generate_greedy(params, CFG, pools, ok, table, 1, cached_len=20)
    with pytest.raises(ValueError, match="block_table"):
        generate_greedy(params, CFG, pools, ok, table, 20)  # 20 + 19 tokens need 3 blocks
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(n_heads=6, n_kv_heads=4)
    # Nothing was consumed by the failed calls: the pools are still usable.
    logits, new_pools = prefill(params, CFG, pools, ok, table)
    assert bool(jnp.isfinite(logits).all())
    # But a successful call donated them: reusing the old list is refused clearly.
    with pytest.raises(ValueError, match="kv_pools"):
        prefill(params, CFG, pools, ok, table)
    # Host (numpy) pools are accepted too.
    host = [np.asarray(p) for p in new_pools]
    logits2, _ = prefill(params, CFG, host, ok, table)
    assert bool(jnp.isfinite(logits2).all())
