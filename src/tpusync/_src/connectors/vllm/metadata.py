"""What the scheduler side tells the worker side each step (vLLM carries it across the
process boundary with the step's scheduler output): plain dataclasses of ids and hashes."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

__all__ = ["LoadSpec", "SaveSpec", "TpuSyncMetadata"]


@dataclass
class LoadSpec:
    """Load the blocks pinned by lookup ``sequence`` of ``req_id`` into ``block_ids`` (the
    request's blocks after vLLM's own prefix hit); ``is_async``: from a tier below DRAM, in the
    background, reported in ``finished_recving``; ``skip_blocks``: the hit's first blocks that
    get no block (vLLM's null block: out of a sliding window), not loaded."""

    req_id: str
    sequence: int
    block_ids: list[int]
    is_async: bool
    skip_blocks: int = 0


@dataclass
class SaveSpec:
    """Save the blocks that became full this step: ``block_hashes[i]`` is in ``block_ids[i]``."""

    req_id: str
    block_hashes: list[bytes]
    block_ids: list[int]
    parent_hash: bytes | None = None  # the block before the first (for KV events)
    token_ids: list[list[int]] = field(default_factory=list)  # each block's (for KV events)


@dataclass
class TpuSyncMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    releases: list[tuple[str, int]] = field(default_factory=list)  # (req_id, sequence or 0)
    idle: bool = False  # the step runs no forward: vLLM only polls the connector
