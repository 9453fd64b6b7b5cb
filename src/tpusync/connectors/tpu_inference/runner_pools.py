"""The worker side of the tpu-inference connector: the store over a tpu-inference model runner's
KV arrays.

tpu-inference hands the connector its runner (``register_runner``) instead of KV tensors, and
its model steps replace ``runner.kv_caches`` every step (they donate the old arrays). So each
layer's array lives in a :class:`~tpusync.DevicePool`: before a step's loads or saves the pools
take the runner's current arrays (:meth:`DevicePool.update`), and after them the runner gets
the pools' arrays back (a load writes new arrays). Every load runs before the forward that
reads it, and every save returns once its pages are copied out (a background write would
meet the next step's donation)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import jax

from tpusync.connectors.vllm.metadata import TpuSyncMetadata
from tpusync.connectors.vllm.settings import ConnectorSettings
from tpusync.connectors.vllm.worker import WorkerSide
from tpusync.errors import InvalidArgumentError
from tpusync.memory import DevicePool

__all__ = ["RunnerWorkerSide", "check_runner_arrays"]

log = logging.getLogger("tpusync.connectors.tpu_inference")

DOCS = "docs/connectors/tpu_inference.md"


def check_runner_arrays(arrays: Any, num_blocks: int | None) -> list[jax.Array]:
    """``runner.kv_caches`` as a list of KV arrays tpusync can move, or a clear error: one
    ``jax.Array`` per layer, pages on axis 0 (as many as ``num_blocks`` where vLLM said),
    every page whole in each shard (the page axis unsharded)."""
    if isinstance(arrays, jax.Array) or not isinstance(arrays, list | tuple):
        raise InvalidArgumentError(
            f"runner.kv_caches: expected a list of jax.Arrays (one per layer), got "
            f"{type(arrays).__name__}"
        )
    if not arrays:
        raise InvalidArgumentError(
            "runner.kv_caches: the runner holds no KV arrays yet; register the runner after "
            "its KV cache is allocated"
        )
    for i, array in enumerate(arrays):
        where = f"runner.kv_caches[{i}]"
        if not isinstance(array, jax.Array):
            raise InvalidArgumentError(f"{where}: expected a jax.Array, got {type(array).__name__}")
        if array.ndim < 2:
            raise InvalidArgumentError(
                f"{where}: shape {array.shape} has no page axis; tpu-inference's layout is "
                "(num_pages, page_size, heads, packing, head_dim)"
            )
        if num_blocks is not None and int(array.shape[0]) != num_blocks:
            raise InvalidArgumentError(
                f"{where}: {array.shape[0]} pages on axis 0, but vLLM allocated {num_blocks} "
                "blocks; tpusync indexes pages on axis 0 of tpu-inference's layout"
            )
        pages_per_shard = int(array.sharding.shard_shape(array.shape)[0])
        if pages_per_shard != int(array.shape[0]):
            raise InvalidArgumentError(
                f"{where}: its pages (axis 0) are split over the mesh ({array.sharding}: "
                f"{pages_per_shard} of {array.shape[0]} pages a shard); tpusync moves whole "
                "pages and needs the page axis unsharded. Run one engine per data-parallel "
                "rank (a mesh whose data axis is 1) or shard the KV cache along the heads "
                f"only (PartitionSpec(None, None, 'model')); see {DOCS}"
            )
    return list(arrays)


class RunnerWorkerSide(WorkerSide):
    """The store of one tpu-inference engine's worker, over its runner's KV arrays.

    Args:
      settings_for: the connector's settings for a number of KV pages (the DRAM tier holds as
        many pages as the engine unless the extra config says otherwise).
      num_blocks: vLLM's number of KV blocks, when it said.
    """

    def __init__(
        self, settings_for: Callable[..., ConnectorSettings], num_blocks: int | None = None
    ) -> None:
        super().__init__(settings_for(num_blocks=num_blocks), num_blocks)
        self._settings_for = settings_for
        self.runner: Any = None
        self.pools: list[DevicePool] = []

    def register_runner(self, runner: Any) -> None:
        """Opens the store over ``runner.kv_caches`` (one pool per layer) and gives the runner
        the pools' arrays (on a CPU backend a pool holds a copy it owns)."""
        if self.store is not None:
            raise InvalidArgumentError("runner: this connector has a runner registered")
        arrays = check_runner_arrays(getattr(runner, "kv_caches", None), self.num_blocks)
        if self.num_blocks is None:  # the DRAM tier's default capacity: the engine's pages
            self.use_settings(self._settings_for(num_blocks=int(arrays[0].shape[0])))
        pools = [DevicePool(array, name=f"kv_caches[{i}]") for i, array in enumerate(arrays)]
        self.open_store(pools, [pool.name for pool in pools], by_layer=False)
        self.runner = runner
        self.pools = pools
        self._give_back()
        log.info(
            "tpusync tpu-inference: %d KV arrays of shape %s %s, sharded %s",
            len(pools),
            tuple(arrays[0].shape),
            arrays[0].dtype,
            arrays[0].sharding,
        )

    def answer(self, req_id: str, sequence: int, block_hashes: list[bytes]) -> tuple[int, bool]:
        blocks, _ = super().answer(req_id, sequence, block_hashes)
        return blocks, False  # every load runs before the forward (see the module docstring)

    def start_load(self, meta: TpuSyncMetadata) -> None:
        self._take_runner_arrays()
        try:
            super().start_load(meta)
        finally:
            self._give_back()

    def save(self, meta: TpuSyncMetadata) -> None:
        self._take_runner_arrays()
        try:
            super().save(meta)
        finally:
            self._give_back()

    def _take_runner_arrays(self) -> None:
        """The pools take the arrays the runner's last step left (it donated theirs)."""
        if self.runner is None:
            return
        arrays = self.runner.kv_caches
        if len(arrays) != len(self.pools):
            raise InvalidArgumentError(
                f"runner.kv_caches: {len(arrays)} arrays, but the runner registered "
                f"{len(self.pools)}; the connector needs the same layers every step"
            )
        for pool, array in zip(self.pools, arrays, strict=True):
            if array is not pool.array:
                pool.update(array)

    def _give_back(self) -> None:
        if self.runner is not None and self.pools:
            self.runner.kv_caches = [pool.array for pool in self.pools]

    def close(self) -> None:
        super().close()
        self.runner = None
        self.pools = []
