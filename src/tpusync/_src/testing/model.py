"""A small decoder-only transformer in pure JAX with a paged KV cache: a test and demo model.

Architecture: token embedding, ``n_layers`` pre-norm blocks (RMSNorm, grouped-query attention with
RoPE, SwiGLU MLP), final RMSNorm and an untied LM head. Weights are random, drawn from
``config.seed``; the model exists to produce real KV caches and logits, not text.

Paged KV cache
--------------
``kv_pools`` is a list of ``2 * n_layers`` arrays ordered ``[layer0.k, layer0.v, layer1.k, ...]``,
each of shape ``(num_blocks, block_size, n_kv_heads, head_dim)`` (:func:`init_kv_pools`). A
sequence's *block table* lists its block ids in order: the K/V of the token at absolute position
``p`` live in block ``block_table[p // block_size]``, slot ``p % block_size``. Copying a block's
rows in every pool to another block id (and pointing a block table at it) moves that KV exactly.

Chunked prefill and buckets
---------------------------
:func:`prefill` processes tokens ``[start_pos, start_pos + len(tokens))``; the KV of positions
``< start_pos`` must already be in the pools through ``block_table``. Chunks longer than
``config.max_chunk`` are split into pieces of ``max_chunk`` tokens counted from ``start_pos``
(deterministic, so the same ``start_pos`` and length always give the same pieces). Each piece is
padded to a bucket length (a power of two, at least 16, at most ``max_chunk``; or ``pad_to``)
and the attended context to a power-of-two number of blocks (at most ``max_blocks_per_seq``), so
different chunk sizes reuse compiled code.

Pad tokens never affect results and never write KV: their scatter index is ``num_blocks`` (out of
range) and the scatter uses ``mode="drop"``; pad queries' outputs are discarded; keys past the last
real token are masked out (scores to ``-inf`` and values to zero, so even non-finite garbage in
unused blocks cannot leak in). Pools are donated to the jitted function: after a call, use the
returned pools, not the ones passed in.

Exactness: results depend only on the tokens, the positions, the chunk boundaries and the KV
*values* of the prefix, not on which block ids hold them, so the same chunking over a prefix whose
blocks were copied elsewhere gives bitwise identical logits.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
KVPools = list[jax.Array]

_MIN_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Model and KV-pool shape. Frozen (hashable): it is a static argument of the jitted code."""

    vocab_size: int = 512
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 768
    block_size: int = 16
    num_blocks: int = 1024
    max_blocks_per_seq: int = 512
    max_chunk: int = 1024
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "d_ff",
            "block_size",
            "num_blocks",
            "max_blocks_per_seq",
            "max_chunk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_heads ({self.n_heads}) must be a multiple of "
                f"n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        jnp.dtype(self.dtype)  # raises TypeError on an unknown dtype name

    @property
    def max_seq_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def kv_pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_blocks, self.block_size, self.n_kv_heads, self.head_dim)


class Generation(NamedTuple):
    """Result of :func:`generate_greedy`."""

    tokens: np.ndarray  # (n_new,) int32, the greedy continuation
    prefill_logits: np.ndarray  # (vocab_size,) logits of the last prompt token
    kv_pools: KVPools  # the pools after generation (the ones passed in were donated)


def blocks_needed(config: ModelConfig, n_tokens: int) -> int:
    """Number of KV blocks that hold ``n_tokens`` tokens."""
    return -(-n_tokens // config.block_size)


def init_params(config: ModelConfig) -> Params:
    """Random weights from ``config.seed``, scaled (1/sqrt(fan_in), residual outputs further by
    1/sqrt(2 * n_layers)) so activations stay O(1) through the network."""
    dtype = jnp.dtype(config.dtype)
    d, h, kv, hd, f = (
        config.d_model,
        config.n_heads,
        config.n_kv_heads,
        config.head_dim,
        config.d_ff,
    )
    keys = iter(jax.random.split(jax.random.key(config.seed), 2 + 7 * config.n_layers))
    residual_scale = 1.0 / math.sqrt(2 * config.n_layers)

    def dense(fan_in: int, fan_out: int, scale: float = 1.0) -> jax.Array:
        w = jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32)
        return (w * (scale / math.sqrt(fan_in))).astype(dtype)

    params: Params = {
        "embed": jax.random.normal(next(keys), (config.vocab_size, d), jnp.float32).astype(dtype),
        "layers": [],
        "final_norm": jnp.ones((d,), dtype),
    }
    for _ in range(config.n_layers):
        params["layers"].append(
            {
                "attn_norm": jnp.ones((d,), dtype),
                "wq": dense(d, h * hd),
                "wk": dense(d, kv * hd),
                "wv": dense(d, kv * hd),
                "wo": dense(h * hd, d, residual_scale),
                "mlp_norm": jnp.ones((d,), dtype),
                "w_gate": dense(d, f),
                "w_up": dense(d, f),
                "w_down": dense(f, d, residual_scale),
            }
        )
    params["lm_head"] = dense(d, config.vocab_size)
    return params


def init_kv_pools(config: ModelConfig) -> KVPools:
    """Zeroed pools: ``2 * n_layers`` arrays ``[layer0.k, layer0.v, ...]`` of
    ``config.kv_pool_shape``."""
    return [
        jnp.zeros(config.kv_pool_shape, jnp.dtype(config.dtype)) for _ in range(2 * config.n_layers)
    ]


# ---------------------------------------------------------------------------------------------
# The jitted core


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(x.dtype)


def _rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE; x: (C, heads, head_dim), positions: (C,) absolute."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (np.arange(half, dtype=np.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = jnp.cos(angles)[:, None, :]
    sin = jnp.sin(angles)[:, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(1,))
def _forward(
    params: Params,
    kv_pools: KVPools,
    tokens: jax.Array,
    n_valid: jax.Array,
    start_pos: jax.Array,
    block_table: jax.Array,
    *,
    config: ModelConfig,
) -> tuple[jax.Array, KVPools]:
    """One padded piece. tokens: (C,) int32 with ``n_valid`` real tokens first; block_table:
    (B,) int32 covering the context (entries past the real context are ignored)."""
    c = tokens.shape[0]
    bs = config.block_size
    t = block_table.shape[0] * bs  # attended context length (padded)
    h, kvh, hd = config.n_heads, config.n_kv_heads, config.head_dim
    g = h // kvh

    idx = jnp.arange(c, dtype=jnp.int32)
    positions = start_pos + idx
    valid = idx < n_valid
    end = start_pos + n_valid  # one past the last real token
    table_idx = jnp.minimum(positions // bs, block_table.shape[0] - 1)
    write_block = jnp.where(valid, block_table[table_idx], config.num_blocks)  # pads: dropped
    write_slot = positions % bs

    key_pos = jnp.arange(t, dtype=jnp.int32)
    mask = key_pos[None, :] <= positions[:, None]  # causal; (C, T)
    key_live = (key_pos < end)[:, None, None]  # (T, 1, 1)
    mask_g = jnp.tile(mask, (g, 1))  # (g * C, T), rows ordered (group, query)
    scale = 1.0 / math.sqrt(hd)

    x = params["embed"][tokens]
    new_pools: KVPools = []
    for layer, p in enumerate(params["layers"]):
        hn = _rms_norm(x, p["attn_norm"], config.norm_eps)
        q = _rope((hn @ p["wq"]).reshape(c, h, hd), positions, config.rope_theta)
        k = _rope((hn @ p["wk"]).reshape(c, kvh, hd), positions, config.rope_theta)
        v = (hn @ p["wv"]).reshape(c, kvh, hd)

        k_pool = kv_pools[2 * layer].at[write_block, write_slot].set(k, mode="drop")
        v_pool = kv_pools[2 * layer + 1].at[write_block, write_slot].set(v, mode="drop")
        new_pools += [k_pool, v_pool]

        k_ctx = jnp.where(key_live, k_pool[block_table].reshape(t, kvh, hd), 0)
        v_ctx = jnp.where(key_live, v_pool[block_table].reshape(t, kvh, hd), 0)
        # Grouped-query attention as kvh batched matmuls of (g * C, hd) x (hd, T).
        qg = (q.astype(jnp.float32) * scale).reshape(c, kvh, g, hd)
        qg = qg.transpose(1, 2, 0, 3).reshape(kvh, g * c, hd)
        kt = k_ctx.astype(jnp.float32).transpose(1, 0, 2)  # (kvh, T, hd)
        vt = v_ctx.astype(jnp.float32).transpose(1, 0, 2)
        scores = jnp.einsum("kqd,ktd->kqt", qg, kt)
        scores = jnp.where(mask_g[None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("kqt,ktd->kqd", probs, vt).reshape(kvh, g, c, hd)
        attn = attn.transpose(2, 0, 1, 3).reshape(c, h * hd)
        x = x + (attn.astype(x.dtype) @ p["wo"])

        hn = _rms_norm(x, p["mlp_norm"], config.norm_eps)
        x = x + (jax.nn.silu(hn @ p["w_gate"]) * (hn @ p["w_up"])) @ p["w_down"]

    last = jax.lax.dynamic_index_in_dim(x, n_valid - 1, axis=0, keepdims=False)
    last = _rms_norm(last, params["final_norm"], config.norm_eps)
    logits = (last @ params["lm_head"]).astype(jnp.float32)
    return logits, new_pools


# ---------------------------------------------------------------------------------------------
# Validation and the public API


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _as_int_array(value: Any, name: str, ndim: int) -> np.ndarray:
    try:
        arr = np.asarray(value)
    except Exception as exc:  # pragma: no cover - exotic inputs
        raise ValueError(f"{name} must be an array of integers: {exc}") from exc
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {arr.shape}")
    return arr.astype(np.int64)


def _check_pools(config: ModelConfig, kv_pools: Sequence[jax.Array]) -> None:
    if not isinstance(kv_pools, list | tuple) or len(kv_pools) != 2 * config.n_layers:
        raise ValueError(
            f"kv_pools must be a list of {2 * config.n_layers} arrays (k, v per layer), "
            f"got {type(kv_pools).__name__}"
            + (f" of length {len(kv_pools)}" if isinstance(kv_pools, list | tuple) else "")
        )
    dtype = jnp.dtype(config.dtype)
    for i, pool in enumerate(kv_pools):
        if isinstance(pool, jax.Array) and pool.is_deleted():
            raise ValueError(
                f"kv_pools[{i}] was donated to an earlier call: use the pools that call returned"
            )
        if tuple(pool.shape) != config.kv_pool_shape or pool.dtype != dtype:
            raise ValueError(
                f"kv_pools[{i}] must have shape {config.kv_pool_shape} and dtype {dtype}, "
                f"got {tuple(pool.shape)} {pool.dtype}"
            )


def _check_block_table(config: ModelConfig, block_table: Any, n_tokens_total: int) -> np.ndarray:
    table = _as_int_array(block_table, "block_table", 1)
    need = blocks_needed(config, n_tokens_total)
    if need > config.max_blocks_per_seq:
        raise ValueError(
            f"sequence of {n_tokens_total} tokens needs {need} blocks, more than "
            f"config.max_blocks_per_seq={config.max_blocks_per_seq}"
        )
    if len(table) < need:
        raise ValueError(
            f"block_table has {len(table)} blocks, too short for {n_tokens_total} tokens "
            f"(needs {need} blocks of {config.block_size})"
        )
    table = table[:need]
    if table.size and (table.min() < 0 or table.max() >= config.num_blocks):
        raise ValueError(f"block_table ids must be in [0, {config.num_blocks}), got {table}")
    if len(np.unique(table)) != len(table):
        raise ValueError("block_table holds a block id more than once")
    return table


def _check_tokens(config: ModelConfig, tokens: Any, name: str = "tokens") -> np.ndarray:
    arr = _as_int_array(tokens, name, 1)
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty")
    if arr.min() < 0 or arr.max() >= config.vocab_size:
        raise ValueError(
            f"{name} must be in [0, {config.vocab_size}), got values in [{arr.min()}, {arr.max()}]"
        )
    return arr


def _check_pos(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def _run_piece(
    params: Params,
    config: ModelConfig,
    kv_pools: KVPools,
    tokens: np.ndarray,
    table: np.ndarray,
    start: int,
    bucket: int,
) -> tuple[jax.Array, KVPools]:
    n = len(tokens)
    padded = np.zeros(bucket, np.int32)
    padded[:n] = tokens
    ctx_blocks = min(_next_pow2(blocks_needed(config, start + n)), config.max_blocks_per_seq)
    table_padded = np.zeros(ctx_blocks, np.int32)  # entries past the context are masked out
    used = table[:ctx_blocks]
    table_padded[: len(used)] = used
    return _forward(
        params,
        list(kv_pools),
        jnp.asarray(padded),
        jnp.int32(n),
        jnp.int32(start),
        jnp.asarray(table_padded),
        config=config,
    )


def prefill(
    params: Params,
    config: ModelConfig,
    kv_pools: Sequence[jax.Array],
    tokens: Any,
    block_table: Any,
    start_pos: int = 0,
    *,
    pad_to: int | None = None,
) -> tuple[jax.Array, KVPools]:
    """Prefill ``tokens`` at absolute positions ``start_pos ...``; return (last token's logits
    (vocab_size,) float32, new pools).

    KV of positions ``< start_pos`` must already be in the pools at ``block_table``. The chunk's
    K/V are written to ``block_table[pos // block_size]``, slot ``pos % block_size``. Pieces of at
    most ``config.max_chunk`` tokens are run one after another; each is padded to its bucket
    (``pad_to`` if given, which must be >= the piece length) and pads are masked and not written.
    ``kv_pools`` are donated.
    """
    start = _check_pos(start_pos, "start_pos")
    toks = _check_tokens(config, tokens)
    _check_pools(config, kv_pools)
    table = _check_block_table(config, block_table, start + len(toks))
    if pad_to is not None and (
        isinstance(pad_to, bool)
        or not isinstance(pad_to, int)
        or pad_to < min(len(toks), config.max_chunk)
    ):
        raise ValueError(
            f"pad_to must be an int >= the piece length "
            f"({min(len(toks), config.max_chunk)}), got {pad_to!r}"
        )
    pools = list(kv_pools)
    logits = None
    for offset in range(0, len(toks), config.max_chunk):
        piece = toks[offset : offset + config.max_chunk]
        bucket = pad_to or min(max(_MIN_BUCKET, _next_pow2(len(piece))), config.max_chunk)
        bucket = max(bucket, len(piece))
        logits, pools = _run_piece(params, config, pools, piece, table, start + offset, bucket)
    assert logits is not None
    return logits, pools


def decode_step(
    params: Params,
    config: ModelConfig,
    kv_pools: Sequence[jax.Array],
    token: Any,
    block_table: Any,
    pos: int,
) -> tuple[jax.Array, KVPools]:
    """Run one token at absolute position ``pos`` (KV of ``[0, pos)`` in the pools); write its K/V
    and return (its logits (vocab_size,) float32, new pools). ``kv_pools`` are donated."""
    p = _check_pos(pos, "pos")
    arr = np.asarray(token)
    tok = _check_tokens(config, arr.reshape(1) if arr.ndim == 0 else arr, "token")
    if len(tok) != 1:
        raise ValueError(f"token must be a single token, got {len(tok)}")
    _check_pools(config, kv_pools)
    table = _check_block_table(config, block_table, p + 1)
    return _run_piece(params, config, list(kv_pools), tok, table, p, 1)


def generate_greedy(
    params: Params,
    config: ModelConfig,
    kv_pools: Sequence[jax.Array],
    prompt: Any,
    block_table: Any,
    n_new: int,
    *,
    chunk: int | None = None,
    cached_len: int = 0,
) -> Generation:
    """Greedy continuation of ``prompt`` by ``n_new`` tokens.

    The KV of ``prompt[:cached_len]`` must already be in the pools (a prefix-cache hit; use
    ``cached_len <= len(prompt) - 1`` so the last token is recomputed and has logits). The rest
    of the prompt is prefilled in chunks of ``chunk`` tokens (default ``config.max_chunk``)
    starting at ``cached_len``, then ``n_new - 1`` decode steps follow. ``block_table`` must cover
    ``len(prompt) + n_new - 1`` tokens. ``kv_pools`` are donated; use ``result.kv_pools``.
    """
    toks = _check_tokens(config, prompt, "prompt")
    n_new = _check_pos(n_new, "n_new")
    cached = _check_pos(cached_len, "cached_len")
    if cached >= len(toks):
        raise ValueError(
            f"cached_len must be < len(prompt) ({len(toks)}): the last prompt token is always "
            f"recomputed, got {cached}"
        )
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    step = chunk or config.max_chunk
    _check_pools(config, kv_pools)
    table = _check_block_table(config, block_table, len(toks) + max(n_new, 1) - 1)

    pools = list(kv_pools)
    logits = None
    for s in range(cached, len(toks), step):
        logits, pools = prefill(params, config, pools, toks[s : s + step], table, s)
    assert logits is not None
    prefill_logits = np.asarray(logits)
    out: list[int] = []
    pos = len(toks)
    for i in range(n_new):
        nxt = int(jnp.argmax(logits))
        out.append(nxt)
        if i + 1 < n_new:
            logits, pools = decode_step(params, config, pools, nxt, table, pos)
            pos += 1
    return Generation(np.asarray(out, np.int32), prefill_logits, pools)


def _main() -> None:  # pragma: no cover - manual timing: python -m tpusync.testing.model [N]
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    config = ModelConfig(max_blocks_per_seq=max(512, blocks_needed(ModelConfig(), n)))
    config = dataclasses.replace(
        config, num_blocks=max(config.num_blocks, config.max_blocks_per_seq)
    )
    params = init_params(config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, n)
    table = np.arange(blocks_needed(config, n))
    for label in ("with compilation", "compiled"):
        pools = init_kv_pools(config)
        t0 = time.perf_counter()
        logits, pools = prefill(params, config, pools, tokens, table, 0)
        logits.block_until_ready()
        print(f"prefill {n} tokens ({label}): {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":  # pragma: no cover
    _main()
