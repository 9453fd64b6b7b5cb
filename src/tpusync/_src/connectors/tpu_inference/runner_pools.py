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

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import jax

from tpusync._src.connectors.vllm.metadata import TpuSyncMetadata
from tpusync._src.connectors.vllm.settings import ConnectorSettings
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync._src.memory.device_pool import DevicePool
from tpusync.errors import InvalidArgumentError

__all__ = ["RunnerWorkerSide", "check_runner_arrays"]

log = logging.getLogger("tpusync.connectors.tpu_inference")

DOCS = "docs/connectors/tpu_inference.md"


def check_runner_arrays(arrays: Any, num_blocks: int | None) -> list[jax.Array]:
    """``runner.kv_caches`` as a list of KV arrays tpusync can move, or a clear error: one
    ``jax.Array`` per layer, pages on axis 0 (as many as ``num_blocks`` where vLLM said),
    every page whole in each shard (the page axis unsharded), no array at two layers."""
    if isinstance(arrays, jax.Array) or not isinstance(arrays, list | tuple):
        raise InvalidArgumentError(
            f"runner.kv_caches: expected a list of jax.Arrays (one per layer), got "
            f"{type(arrays).__name__}; register tpu-inference's model runner once its KV cache "
            "is allocated"
        )
    if not arrays:
        raise InvalidArgumentError(
            "runner.kv_caches: the runner holds no KV arrays yet; register the runner after "
            "its KV cache is allocated"
        )
    layer_of: dict[int, int] = {}  # id(array) -> the first layer that holds it
    for i, array in enumerate(arrays):
        where = f"runner.kv_caches[{i}]"
        if not isinstance(array, jax.Array):
            raise InvalidArgumentError(f"{where}: expected a jax.Array, got {type(array).__name__}")
        first = layer_of.setdefault(id(array), i)
        if first != i:  # one pool per layer: a load into one would write over the other's pages
            raise InvalidArgumentError(
                f"runner.kv_caches[{first}] and runner.kv_caches[{i}]: the same jax.Array at two "
                "layers; tpusync keeps each layer's pages apart, so give every layer an array "
                "of its own"
            )
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
      settings: the connector's settings, as it read them.
      num_blocks: vLLM's number of KV blocks, when it said.
      settings_for: the connector's settings for a number of KV pages, read again only when
        vLLM did not say ``num_blocks`` (the DRAM tier holds as many pages as the engine unless
        the extra config says otherwise, so the runner's arrays tell it then).
    """

    def __init__(
        self,
        settings: ConnectorSettings,
        num_blocks: int | None = None,
        settings_for: Callable[..., ConnectorSettings] | None = None,
    ) -> None:
        super().__init__(settings, num_blocks)
        self._settings_for = settings_for
        self.runner: Any = None
        self.pools: list[DevicePool] = []
        self._may_warn_no_runner = True  # until a runner registers, or the warning is said

    def register_runner(self, runner: Any) -> None:
        """Opens the store over ``runner.kv_caches`` (one pool per layer) and gives the runner
        the pools' arrays (on a CPU backend a pool holds a copy it owns)."""
        if self.store is not None:
            raise InvalidArgumentError("runner: this connector has a runner registered")
        if not hasattr(runner, "kv_caches"):
            raise InvalidArgumentError(
                f"runner: a {type(runner).__name__} has no kv_caches attribute; pass "
                "tpu-inference's TPU model runner, once its KV cache is allocated (its "
                "kv_caches: one jax.Array per layer)"
            )
        arrays = check_runner_arrays(runner.kv_caches, self.num_blocks)
        if self.num_blocks is None and self._settings_for is not None:
            # the DRAM tier's default capacity: the engine's pages, known only now
            self.use_settings(self._settings_for(num_blocks=int(arrays[0].shape[0])))
        pools = [DevicePool(array, name=f"kv_caches[{i}]") for i, array in enumerate(arrays)]
        self.open_store(pools, [pool.name for pool in pools], by_layer=False)
        self.runner = runner
        self.pools = pools
        self._may_warn_no_runner = False
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
        with self._runner_arrays():
            super().start_load(meta)

    def save(self, meta: TpuSyncMetadata) -> None:
        with self._runner_arrays():
            super().save(meta)

    @contextlib.contextmanager
    def _runner_arrays(self) -> Iterator[None]:
        """The pools hold the runner's current arrays for the ``with`` block, and the runner
        gets the pools' arrays back after it, also when it raises."""
        self._take_runner_arrays()
        try:
            yield
        finally:
            self._give_back()

    def _warn_without_runner(self) -> None:
        """Says once that no runner is registered: every step then loads and saves nothing,
        and the scheduler's lookups find no socket (misses), which nothing else reports."""
        if not self._may_warn_no_runner:
            return
        self._may_warn_no_runner = False
        log.warning(
            "tpusync tpu-inference: a step ran before register_runner(runner): nothing is "
            "loaded or saved and every lookup is a miss until it is called. tpu-inference's "
            "TPU worker calls it once the KV cache is allocated; a worker that does not must "
            "call connector.register_runner(runner) itself (see %s)",
            DOCS,
        )

    def _take_runner_arrays(self) -> None:
        """The pools take the arrays the runner's last step left (it donated theirs)."""
        if self.runner is None:
            self._warn_without_runner()
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
