"""tpusync as vLLM's KV store: :class:`TpuSyncConnector` (vLLM's KV connector v1).

Imports vLLM (run it where vLLM is installed). See docs/connectors/vllm.md."""

from tpusync.connectors.vllm.connector import TpuSyncConnector
from tpusync.connectors.vllm.metadata import TpuSyncMetadata

__all__ = ["TpuSyncConnector", "TpuSyncMetadata"]
