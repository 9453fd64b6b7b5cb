"""What tpusync owns in memory: device pools it may write, host buffers, huge pages, fork guards.

The lowest Python layer above the native core: it imports nothing of the engines, the transfer
API or the tiers.
"""

from __future__ import annotations

from tpusync.memory.device_pool import DevicePool
from tpusync.memory.host_buffer import HostBuffer
from tpusync.memory.torch_tensors import TorchPool, prefault_cpu_tensors

__all__ = ["DevicePool", "HostBuffer", "TorchPool", "prefault_cpu_tensors"]
