"""tpusync: move LLM state — KV caches and weights — between device memory, host memory and tiers.

The public API is this module's ``__all__`` and the modules :mod:`tpusync.kv`,
:mod:`tpusync.tiers`, :mod:`tpusync.cluster`, :mod:`tpusync.weights`, :mod:`tpusync.connectors`
(``vllm``, ``sglang``, ``tpu_inference``), :mod:`tpusync.errors`, :mod:`tpusync.options` and
:mod:`tpusync.testing`; each public name is exported from one of them. Everything under
``tpusync._src`` (and any other path with a part starting with ``_``) is private and may change
without notice (docs/decisions/0014-privacy-line.md).
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from tpusync import errors, options
from tpusync._version import __version__

# A library adds no output of its own: its records reach the application's handlers only
# (without one, logging.lastResort does not print them to stderr).
logging.getLogger("tpusync").addHandler(logging.NullHandler())

# The one read of the TPUSYNC_* environment variables (documented in tpusync.options).
options.set_current(options.from_environment())

# The fork guard notes a fork after JAX started from the first import on (it imports no JAX).
from tpusync._src.memory import fork_guard as _fork_guard  # noqa: E402, F401

if TYPE_CHECKING:
    from tpusync._src.info import info
    from tpusync._src.memory.device_pool import DevicePool
    from tpusync._src.memory.host_buffer import HostBuffer
    from tpusync._src.memory.torch_tensors import TorchPool
    from tpusync._src.transfer import Transfer, TransferFuture, transfer, transfer_batch

__all__ = [
    "DevicePool",
    "HostBuffer",
    "TorchPool",
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
# `tpusync` command's --version and --help) costs no JAX import.
_LAZY = {
    "DevicePool": "tpusync._src.memory.device_pool",
    "HostBuffer": "tpusync._src.memory.host_buffer",
    "TorchPool": "tpusync._src.memory.torch_tensors",
    "Transfer": "tpusync._src.transfer",
    "TransferFuture": "tpusync._src.transfer",
    "info": "tpusync._src.info",
    "transfer": "tpusync._src.transfer",
    "transfer_batch": "tpusync._src.transfer",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads find it without this call
        return value
    raise AttributeError(f"module 'tpusync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
