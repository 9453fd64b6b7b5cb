"""tpusync as vLLM's KV store: :class:`TpuSyncConnector` (vLLM's KV connector v1).

The connector imports vLLM (run it where vLLM is installed), on first use of its name: vLLM finds
the class with ``getattr`` on this module, and the scheduler's lookup client, which needs no vLLM,
imports this package's parents without it. See docs/connectors/vllm.md."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpusync._src.connectors.vllm.connector import TpuSyncConnector
    from tpusync._src.connectors.vllm.metadata import TpuSyncMetadata

__all__ = ["TpuSyncConnector", "TpuSyncMetadata"]

_LAZY = {
    "TpuSyncConnector": "tpusync._src.connectors.vllm.connector",
    "TpuSyncMetadata": "tpusync._src.connectors.vllm.metadata",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads find it without this call
        return value
    raise AttributeError(f"module 'tpusync.connectors.vllm' has no attribute {name!r}")
