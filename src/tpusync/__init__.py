"""tpusync: move LLM state — KV caches and weights — between device memory, host memory and tiers.

The public surface is what ``__all__`` lists; modules and names starting with ``_`` may change
without notice.
"""

from __future__ import annotations

from tpusync import errors
from tpusync.device_pool import DevicePool
from tpusync.errors import TpuSyncError
from tpusync.host_buffer import HostBuffer
from tpusync.info import info
from tpusync.transfer import Transfer, TransferFuture, transfer, transfer_batch

__version__ = "0.1.0.dev0"

__all__ = [
    "DevicePool",
    "HostBuffer",
    "TpuSyncError",
    "Transfer",
    "TransferFuture",
    "__version__",
    "errors",
    "info",
    "transfer",
    "transfer_batch",
]
