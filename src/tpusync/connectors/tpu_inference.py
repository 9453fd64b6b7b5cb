"""tpusync as the KV store of vLLM on TPU (tpu-inference): :class:`TpuSyncTpuConnector`.

tpu-inference's TPU platform accepts only the connector names ``TPUConnector``,
``TPUConnectorHMA``, ``TPUOffloadConnector`` and ``RaidenOffloadConnector``; with
``kv_connector_module_path="tpusync.connectors.tpu_inference"`` each of them names
:class:`TpuSyncTpuConnector` (vLLM's factory takes the class of that name from this module).
Imports vLLM. See docs/connectors/tpu_inference.md."""

from __future__ import annotations

from tpusync._src.connectors.tpu_inference.connector import TpuSyncTpuConnector

# the names tpu-inference's platform accepts, each this class when loaded from this module
TPUConnector = TpuSyncTpuConnector
TPUConnectorHMA = TpuSyncTpuConnector
TPUOffloadConnector = TpuSyncTpuConnector
RaidenOffloadConnector = TpuSyncTpuConnector

__all__ = [
    "RaidenOffloadConnector",
    "TPUConnector",
    "TPUConnectorHMA",
    "TPUOffloadConnector",
    "TpuSyncTpuConnector",
]
