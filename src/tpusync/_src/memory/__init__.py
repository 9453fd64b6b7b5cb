"""What tpusync owns in memory: device pools it may write, host buffers, huge pages, fork guards.

The lowest Python layer above the native core: it imports nothing of the engines, the transfer
API or the tiers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpusync._src.memory.device_pool import DevicePool
    from tpusync._src.memory.host_buffer import HostBuffer
    from tpusync._src.memory.torch_tensors import TorchPool, prefault_cpu_tensors

__all__ = ["DevicePool", "HostBuffer", "TorchPool", "prefault_cpu_tensors"]

# Imported on first use: the fork guard below this package is imported by `import tpusync`,
# which imports no JAX (issue 54).
_LAZY = {
    "DevicePool": "tpusync._src.memory.device_pool",
    "HostBuffer": "tpusync._src.memory.host_buffer",
    "TorchPool": "tpusync._src.memory.torch_tensors",
    "prefault_cpu_tensors": "tpusync._src.memory.torch_tensors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads find it without this call
        return value
    raise AttributeError(f"module 'tpusync._src.memory' has no attribute {name!r}")
