"""tpusync: move LLM state — KV caches and weights — between device memory, host memory and tiers.

The public surface is what ``__all__`` lists; modules and names starting with ``_`` may change
without notice. The layers, bottom to top: :mod:`tpusync.errors` and :mod:`tpusync.options`,
the native core, :mod:`tpusync.memory`, :mod:`tpusync.engines`, :mod:`tpusync.transfer`, then
the tiers, the KV store and the cluster.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from tpusync import errors, options
from tpusync._version import __version__

# A library adds no output of its own: its records reach the application's handlers only
# (without one, logging.lastResort does not print them to stderr).
logging.getLogger("tpusync").addHandler(logging.NullHandler())

# The one read of the TPUSYNC_* environment variables (documented in tpusync.options).
options.set_current(options.from_environment())

from tpusync.errors import TpuSyncError  # noqa: E402
from tpusync.info import info  # noqa: E402
from tpusync.memory import DevicePool, HostBuffer, TorchPool  # noqa: E402
from tpusync.transfer import Transfer, TransferFuture, transfer, transfer_batch  # noqa: E402

__all__ = [
    "DevicePool",
    "HostBuffer",
    "TorchPool",
    "TpuSyncError",
    "Transfer",
    "TransferFuture",
    "__version__",
    "errors",
    "info",
    "options",
    "transfer",
    "transfer_batch",
]

# Old spellings kept for one release (issue 19, 0.1.0.dev0): reading a name from them warns.
_MOVED_MODULES = {
    "device_pool": "tpusync.memory.device_pool",
    "host_buffer": "tpusync.memory.host_buffer",
}


def __getattr__(name: str) -> Any:
    if name in _MOVED_MODULES:  # the shim module warns when a name is read from it
        return importlib.import_module(f"tpusync.{name}")
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")
