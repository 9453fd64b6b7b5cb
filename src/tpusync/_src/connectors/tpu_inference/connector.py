"""``TpuSyncTpuConnector``: the vLLM connector for vLLM on TPU (tpu-inference).

The scheduler side is :class:`~tpusync.connectors.vllm.TpuSyncConnector`'s (tpu-inference runs
vLLM's own scheduler). The worker side follows tpu-inference's contract: ``register_kv_caches``
is not how it hands over the KV cache; ``register_runner(runner)`` is, and the connector reads
``runner.kv_caches`` (one ``jax.Array`` per layer, ``(num_pages, page_size, heads, packing,
head_dim)``, replaced every step) and writes loaded arrays back into it
(:mod:`.runner_pools`)."""

from __future__ import annotations

from typing import Any

import jax
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from tpusync._src.connectors.tpu_inference.runner_pools import RunnerWorkerSide
from tpusync._src.connectors.vllm.connector import TpuSyncConnector
from tpusync._src.connectors.vllm.settings import WHERE, ConnectorSettings
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync.errors import InvalidArgumentError

__all__ = ["TPU_TOKEN_AXIS", "TpuSyncTpuConnector"]

TPU_TOKEN_AXIS = 1  # tpu-inference's layout per layer: (num_pages, page_size, heads, packing, dim)


class TpuSyncTpuConnector(TpuSyncConnector):
    """vLLM KV connector for tpu-inference's TPU worker, over a tpusync KV store.

    tpu-inference accepts only its own connector names, so load it under one of them with this
    module's path: ``KVTransferConfig(kv_connector="TPUConnector",
    kv_connector_module_path="tpusync.connectors.tpu_inference", kv_role=...,
    kv_connector_extra_config={...})`` (the names ``TPUConnector``, ``TPUConnectorHMA``,
    ``TPUOffloadConnector`` and ``RaidenOffloadConnector`` all name this class here). The extra
    config is the same as :class:`~tpusync.connectors.vllm.TpuSyncConnector`'s.

    One worker drives the whole mesh (tensor parallelism is sharding inside it): every shard of
    a page is stored together. The page axis must not be sharded (see
    :func:`.runner_pools.check_runner_arrays`). Every load runs whole before the forward, so
    ``load_by_layer`` is refused unless left at ``"auto"``."""

    token_axis = TPU_TOKEN_AXIS
    layout_name = "tpu-inference KV layout"

    def _check_parallelism(self, parallel: Any) -> None:
        if parallel.pipeline_parallel_size != 1:
            raise InvalidArgumentError(
                "pipeline_parallel_size: TpuSyncTpuConnector serves one worker per engine; "
                "run with pipeline_parallel_size=1"
            )

    def _check_settings(self, settings: ConnectorSettings) -> None:
        if settings.load_by_layer != "auto":
            # every load runs whole before the forward: the runner donates its arrays each step
            raise InvalidArgumentError(
                f"{WHERE}.load_by_layer: {settings.load_by_layer!r} has no effect on "
                "TpuSyncTpuConnector, which loads every page before the forward (tpu-inference "
                'replaces its KV arrays every step); leave load_by_layer out (or "auto")'
            )

    def _tensor_parallel(self, parallel: Any, role: KVConnectorRole) -> tuple[int, int]:
        return 0, 1  # one worker holds every shard: tensor parallelism is its mesh

    def _new_worker(self, num_blocks: int | None) -> WorkerSide:
        return RunnerWorkerSide(self._settings, num_blocks, settings_for=self._settings_for)

    def register_kv_caches(self, kv_caches: Any) -> None:
        return  # tpu-inference replaces its arrays every step: register_runner reads them

    def register_runner(self, runner: Any) -> None:
        """tpu-inference's hook: the runner whose ``kv_caches`` the connector reads and writes."""
        assert isinstance(self._worker, RunnerWorkerSide)
        if jax.process_count() != 1:  # asked only here: the scheduler's process needs no JAX
            raise InvalidArgumentError(
                f"jax.process_count(): {jax.process_count()} processes; TpuSyncTpuConnector "
                "serves an engine on one host for now"
            )
        self._worker.register_runner(runner)
