"""A small decoder-only transformer in pure JAX with a paged KV cache: a test and demo model
(docs in the functions)."""

from __future__ import annotations

from tpusync._src.testing.model import (
    Generation,
    ModelConfig,
    blocks_needed,
    decode_step,
    generate_greedy,
    init_kv_pools,
    init_params,
    prefill,
)

__all__ = [
    "Generation",
    "ModelConfig",
    "blocks_needed",
    "decode_step",
    "generate_greedy",
    "init_kv_pools",
    "init_params",
    "prefill",
]
