"""tpusync: move LLM state — KV caches and weights — between device memory, host memory and tiers.

The public surface is what ``__all__`` lists; modules and names starting with ``_`` may change
without notice. The layers, bottom to top: :mod:`tpusync.errors` and :mod:`tpusync.options`,
the native core, :mod:`tpusync.memory`, :mod:`tpusync.engines`, :mod:`tpusync.transfer`, then
the tiers, the KV store and the cluster.
"""

from __future__ import annotations

import importlib
import logging
import sys
import types
from typing import TYPE_CHECKING, Any

from tpusync import errors, options
from tpusync._version import __version__
from tpusync.errors import TpuSyncError

# A library adds no output of its own: its records reach the application's handlers only
# (without one, logging.lastResort does not print them to stderr).
logging.getLogger("tpusync").addHandler(logging.NullHandler())

# The one read of the TPUSYNC_* environment variables (documented in tpusync.options).
options.set_current(options.from_environment())

# The fork guard notes a fork after JAX started from the first import on (it imports no JAX).
from tpusync.memory import fork_guard as _fork_guard  # noqa: E402, F401

if TYPE_CHECKING:
    from tpusync.info import info
    from tpusync.memory import DevicePool, HostBuffer, TorchPool
    from tpusync.transfer import Transfer, TransferFuture, transfer, transfer_batch

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

# The public names that need JAX, imported on first use: `import tpusync` (and so the
# `tpusync` command's --version and --help) costs no JAX import (issue 54).
_LAZY = {
    "DevicePool": "tpusync.memory",
    "HostBuffer": "tpusync.memory",
    "TorchPool": "tpusync.memory",
    "Transfer": "tpusync.transfer",
    "TransferFuture": "tpusync.transfer",
    "info": "tpusync.info",
    "transfer": "tpusync.transfer",
    "transfer_batch": "tpusync.transfer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads find it without this call
        return value
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
    """`tpusync.info` and `tpusync.transfer` are functions named like the modules they live in.
    Importing such a module binds it on the package, which would hide the function from the
    lazy lookup above: the package keeps the function's name for the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return  # the import system binding tpusync.info or tpusync.transfer (the module)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
