"""Google TPU Sync's KVCacheManager moving scattered blocks between a JAX array and its host
pool (``d2h`` / ``h2d``), as :mod:`tpusync._src.bench.transfer` moves them with tpusync: one layer
of ``blocks`` random blocks of ``block_bytes`` (bfloat16), device blocks in a random permutation,
host blocks in order. Runs under TPU Sync's interpreter (Python 3.12, jax >= 0.11); on the CPU
backend its "device" is host memory, as ours is.

Answers ``{"op": "d2h"}`` and ``{"op": "h2d"}`` with the seconds of one call; before that, its
first line says whether a round trip moved every byte where it belongs."""

from __future__ import annotations

import sys
import time
from importlib import metadata
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from protocol import config_from_argv, reply, serve
from tpu_sync.api.jax.kv_cache_manager import KVCacheManager


def main(config: dict[str, Any]) -> None:
    blocks, block_bytes = config["blocks"], config["block_bytes"]
    rng = np.random.default_rng(config["seed"])
    source = rng.integers(0, 2**16, size=(blocks, block_bytes // 2), dtype=np.uint16)
    layer = jax.device_put(jnp.asarray(source.view(jnp.bfloat16)))
    order = rng.permutation(blocks).tolist()
    identity = list(range(blocks))
    manager = KVCacheManager(
        [layer],
        local_control_port=0,
        host_blocks_to_allocate=blocks,
        parallelism=config.get("parallelism", 4),
    )
    # The check: device -> host in permuted order, then host -> device in place; the layer
    # must then hold the source's blocks permuted (its host pool is not readable as blocks).
    manager.d2h(order, identity).wait()
    manager.h2d(identity, identity).wait()
    verified = bool(np.array_equal(np.asarray(layer).view(np.uint16), source[order]))
    reply(
        {
            "verified": verified,
            "jax": jax.__version__,
            "tpu_sync": metadata.version("tpu_sync_jax"),
            "backend": jax.default_backend(),
        }
    )

    def handle(request: dict[str, Any]) -> dict[str, Any]:
        if request["op"] == "d2h":
            start = time.perf_counter()
            manager.d2h(order, identity).wait()
        elif request["op"] == "h2d":
            start = time.perf_counter()
            manager.h2d(identity, order).wait()
        else:
            raise ValueError(f"unknown op {request['op']!r}")
        return {"seconds": time.perf_counter() - start}

    serve(handle)


if __name__ == "__main__":
    main(config_from_argv(sys.argv)[1])
