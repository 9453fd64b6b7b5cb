"""``TpuSyncConnector``: vLLM's KV connector (v1) over a tpusync KV store.

vLLM makes one instance in the scheduler's process (role SCHEDULER) and one in each worker
(role WORKER); this class reads the settings in both (so a wrong key fails at engine start)
and hands each call to its side (:mod:`.scheduler`, :mod:`.worker`)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

from tpusync._src.connectors.vllm.layouts import check_attention_layout
from tpusync._src.connectors.vllm.metadata import TpuSyncMetadata
from tpusync._src.connectors.vllm.scheduler import SchedulerSide
from tpusync._src.connectors.vllm.settings import (
    CPU_TOKEN_AXIS,
    ConnectorSettings,
    check_stable_hashing,
    read_settings,
)
from tpusync._src.connectors.vllm.stats import TpuSyncConnectorStats, TpuSyncPromMetrics
from tpusync._src.connectors.vllm.worker import WorkerSide
from tpusync.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["TpuSyncConnector"]

log = logging.getLogger("tpusync.connectors.vllm")


class TpuSyncConnector(KVConnectorBase_V1):
    """vLLM KV connector that offloads full KV blocks into a tpusync store (DRAM, disk,
    shared FS, store nodes) and loads them back for any request whose prefix the store holds.

    Load it with ``KVTransferConfig(kv_connector="TpuSyncConnector", kv_role="kv_both",
    kv_connector_extra_config={...})`` (the plain form of :class:`~tpusync.kv.KVStoreConfig`:
    see :mod:`tpusync._src.connectors.vllm.settings`); add
    ``kv_connector_module_path="tpusync.connectors.vllm"`` where the ``tpusync`` plugin is not
    installed.

    Disaggregated serving: prefill engines run ``kv_role="kv_producer"`` (they save, and
    :meth:`request_finished` returns ``{"tpusync": {"blocks": n}}`` as the request's
    ``kv_transfer_params``), decode engines ``"kv_consumer"`` (they load; a request carrying
    those params waits up to ``remote_wait_s`` for the blocks to reach the store), both with a
    store they share (a store node, or peers found through a registry).

    Tensor parallelism: each worker rank keeps its own shard of every block under keys naming
    its rank, and the scheduler counts a block only as far as every rank holds it."""

    # what the worker's KV arrays look like: tokens on this axis (blocks on axis 0)
    token_axis: int = CPU_TOKEN_AXIS
    layout_name: str = "CPU KV layout"

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        cache = vllm_config.cache_config
        self._check_parallelism(vllm_config.parallel_config)
        tp_rank, tp_size = self._tensor_parallel(vllm_config.parallel_config, role)
        num_blocks = getattr(kv_cache_config, "num_blocks", None)
        # the settings for a number of KV blocks (None: the scheduler's, which opens no store)
        self._settings_for = functools.partial(
            read_settings,
            transfer.kv_connector_extra_config,
            model=str(vllm_config.model_config.model),
            block_size=int(cache.block_size),
            tp_rank=tp_rank,
            tp_size=tp_size,
            engine_id=str(transfer.engine_id),
            role=str(transfer.kv_role),
            token_axis=self.token_axis,
            layout=self.layout_name,
        )
        self._settings = self._settings_for(
            num_blocks=num_blocks if role == KVConnectorRole.WORKER else None
        )
        self._check_settings(self._settings)
        check_stable_hashing(
            str(cache.prefix_caching_hash_algo), allow_xxhash=self._settings.allow_xxhash
        )
        if getattr(vllm_config.scheduler_config, "async_scheduling", False):
            # its next step's saves would be built before this step's load errors arrive
            raise InvalidArgumentError(
                "async_scheduling: TpuSyncConnector needs it off (async_scheduling=False)"
            )
        check_attention_layout(
            kv_cache_config,
            str(transfer.kv_load_failure_policy),
            prefix_caching=bool(cache.enable_prefix_caching),
        )
        self._block_size = int(cache.block_size)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(self._settings, self._block_size)
        else:
            self._worker = self._new_worker(num_blocks)

    def _check_parallelism(self, parallel: Any) -> None:
        """Refuses a parallel layout this connector cannot serve."""
        if parallel.pipeline_parallel_size != 1:
            raise InvalidArgumentError(
                "pipeline_parallel_size: TpuSyncConnector serves tensor parallelism only; run "
                "with pipeline_parallel_size=1"
            )

    def _check_settings(self, settings: ConnectorSettings) -> None:
        """Refuses settings this connector would not honour (every one here does)."""

    def _tensor_parallel(self, parallel: Any, role: KVConnectorRole) -> tuple[int, int]:
        """(this worker's tensor-parallel rank, the number of ranks): each rank keeps its own
        shard of every block under keys that name its rank (the scheduler's rank is 0)."""
        size = int(parallel.tensor_parallel_size)
        if size == 1 or role != KVConnectorRole.WORKER:
            return 0, size
        return int(get_tensor_model_parallel_rank()), size

    def _new_worker(self, num_blocks: int | None) -> WorkerSide:
        return WorkerSide(self._settings, num_blocks)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save dropped at preemption is only a later miss

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # the store holds views of vLLM's KV tensors: a sleep that frees and remaps them would
        # leave it reading and writing freed memory
        return False

    def may_load_async(self, request: Any) -> bool:
        """Whether a hit of ``request`` may load in the background: only from tiers below
        DRAM (a store without them loads every hit before the forward)."""
        return bool(self._settings.store.tiers)

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: drops the store's blocks of
        this engine's namespace in every tier (in one process; across processes the scheduler
        cannot reach the store: False)."""
        assert self._scheduler is not None
        return self._scheduler.reset_store()

    # --- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.worker_output(connector_output)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.null_block_id = int(gpu_block_pool.null_block.block_id)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return False, self._scheduler.finished(request)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    def take_events(self) -> Iterable[Any]:
        assert self._scheduler is not None
        return self._scheduler.take_events()

    # --- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # every layer's full blocks are saved together once the step has run them

    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        return None, self._worker.finished_loads() or None

    def get_kv_connector_kv_cache_events(self) -> Any:
        assert self._worker is not None
        return self._worker.events.take()

    def get_kv_connector_stats(self) -> TpuSyncConnectorStats | None:
        if self._worker is None:
            return None
        data = self._worker.take_stats()
        return TpuSyncConnectorStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> TpuSyncConnectorStats | None:
        return TpuSyncConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TpuSyncPromMetrics:
        return TpuSyncPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._scheduler is not None:
            self._scheduler.close()

    def _meta(self) -> TpuSyncMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TpuSyncMetadata)
        return meta
