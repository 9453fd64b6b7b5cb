"""tpusync as SGLang's HiCache storage: :class:`TpuSyncHiCacheStorage`.

Imports SGLang (run it where SGLang is installed). Loaded with ``--hicache-storage-backend
dynamic --hicache-storage-backend-extra-config '{"backend_name": "tpusync", "module_path":
"tpusync.connectors.sglang", "class_name": "TpuSyncHiCacheStorage", "interface_v1": 1, ...}'``.
See docs/connectors/sglang.md."""

from __future__ import annotations

from tpusync._src.connectors.sglang.storage import TpuSyncHiCacheStorage

__all__ = ["TpuSyncHiCacheStorage"]
