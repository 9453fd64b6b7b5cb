"""The connector's figures in vLLM's own stats: what each worker's store did since vLLM last
asked (:class:`TpuSyncConnectorStats`, summed over ranks and intervals by vLLM's logger), as
Prometheus counters on the engine's ``/metrics`` (:class:`TpuSyncPromMetrics`), and the tier a
hit's tokens come from (:func:`hit_sources`, vLLM's ``CacheHitSource``).

Counters (``data`` keys; ``<tier>`` is a store tier's name: ``dram``, ``disk``, ``shared_fs``,
``node``, ``cluster``, ...): ``hit_tokens.<tier>`` (tokens loaded that the lookup found in
the tier),
``checksum_failures.<tier>``, ``loaded_bytes``, ``load_seconds``, ``loads``,
``load_failed_blocks`` (blocks reported to vLLM as failed: recomputed or failed requests),
``saved_bytes``, ``save_seconds`` (a step's wait for its saves to leave vLLM's tensors),
``saved_blocks``."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tpusync._src.kv.tier_specs import DiskTier, SharedFsTier

__all__ = [
    "CacheHitSource",
    "StatsCounter",
    "TpuSyncConnectorStats",
    "TpuSyncPromMetrics",
    "hit_sources",
    "lower_tiers_source",
    "tier_sources",
]

PER_TIER = ("hit_tokens", "checksum_failures")


def tier_sources(config: Any) -> dict[str, CacheHitSource]:
    """vLLM's name for where each tier of a store (``KVStoreConfig``) gets its blocks, by the
    tier's name: DRAM is ``host``, a disk or a shared filesystem ``disk``, a store node or the
    cluster's peers ``p2p``."""
    sources = {"dram": CacheHitSource.HOST}
    for spec in config.tiers:
        disk = isinstance(spec, DiskTier | SharedFsTier)
        sources[spec.name] = CacheHitSource.DISK if disk else CacheHitSource.P2P
    return sources


def lower_tiers_source(sources: dict[str, CacheHitSource]) -> CacheHitSource:
    """The source of a store's blocks below DRAM where its lower tiers share one, else
    ``external_unspecified``."""
    lower = {source for tier, source in sources.items() if tier != "dram"}
    return lower.pop() if len(lower) == 1 else CacheHitSource.EXTERNAL_UNSPECIFIED


def hit_sources(
    tiers: tuple[str, ...], sources: dict[str, CacheHitSource], block_size: int, tokens: int
) -> dict[Any, int]:
    """``tokens`` of a hit (its first blocks, found in ``tiers``) split by vLLM's
    ``CacheHitSource``; only non-zero counts, summing to ``tokens``."""
    split: dict[Any, int] = {}
    left = tokens
    for tier in tiers:
        if left <= 0:
            break
        n = min(block_size, left)
        source = sources.get(tier, CacheHitSource.EXTERNAL_UNSPECIFIED)
        split[source] = split.get(source, 0) + n
        left -= n
    if left > 0:
        split[CacheHitSource.EXTERNAL_UNSPECIFIED] = left
    return split


@dataclass
class TpuSyncConnectorStats(KVConnectorStats):
    """Counters since the last report; ``aggregate`` sums them (ranks, intervals)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> TpuSyncConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {
            k: round(v, 6) if isinstance(v, float) else v for k, v in sorted(self.data.items())
        }
        seconds = self.data.get("load_seconds", 0.0)
        if seconds > 0:
            reduced["load_gbps"] = round(self.data.get("loaded_bytes", 0) / seconds / 1e9, 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsCounter:
    """The worker side's counters, taken (and zeroed) by vLLM each step. Thread-safe: loads in
    the background add to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, int | float] = {}
        self._tiers: dict[str, dict[str, int]] = {}  # the tiers' own counters last seen

    def add(self, **counts: int | float) -> None:
        with self._lock:
            for key, value in counts.items():
                self._data[key] = self._data.get(key, 0) + value

    def take(self, store_tiers: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """The counters since the last call, with the tiers' own (``store.stats()["tiers"]``)
        turned into differences since then."""
        with self._lock:
            data, self._data = self._data, {}
            for tier, counters in store_tiers.items():
                seen = self._tiers.setdefault(tier, {})  # the store counts from its opening
                now = int(counters.get("checksum_failures", 0))
                delta, seen["checksum_failures"] = now - seen.get("checksum_failures", 0), now
                if delta > 0:
                    data[f"checksum_failures.{tier}"] = delta
        return data


class TpuSyncPromMetrics(KVConnectorPromMetrics):
    """The connector's counters on vLLM's ``/metrics`` (``vllm:tpusync_*``), per engine and,
    for the per-tier ones, per tier."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        helps = {
            "hit_tokens": "Prompt tokens loaded from the tpusync store, by tier",
            "checksum_failures": "Blocks of a tpusync tier that failed their checksum (a miss)",
            "loaded_bytes": "KV bytes loaded from the tpusync store into vLLM's blocks",
            "load_seconds": "Seconds spent loading KV from the tpusync store",
            "loads": "Loads from the tpusync store",
            "load_failed_blocks": "Blocks the tpusync store failed to load (recomputed or failed)",
            "saved_bytes": "KV bytes saved from vLLM's blocks into the tpusync store",
            "save_seconds": "Seconds steps waited for saves to leave vLLM's blocks",
            "saved_blocks": "Blocks saved into the tpusync store",
        }
        self._counters: dict[str, Any] = {}
        for name, documentation in helps.items():
            labels = [*labelnames, "tier"] if name in PER_TIER else labelnames
            self._counters[name] = self._counter_cls(
                name=f"vllm:tpusync_{name}", documentation=documentation, labelnames=labels
            )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if value <= 0:
                continue
            name, _, tier = key.partition(".")
            counter = self._counters.get(name)
            if counter is None:
                continue
            (counter.labels(*engine, tier) if tier else counter.labels(*engine)).inc(value)
