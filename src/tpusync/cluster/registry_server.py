"""Deprecated: this module moved to
tpusync.cluster.registry.server and tpusync.cluster.registry.client
(this path goes in the next release)."""

import warnings
from typing import Any

import tpusync.cluster._handshake
import tpusync.cluster._tcp_server
import tpusync.cluster.registry._wire
import tpusync.cluster.registry.base
import tpusync.cluster.registry.client
import tpusync.cluster.registry.server
import tpusync.errors

warnings.warn(
    "tpusync.cluster.registry_server is deprecated: import from "
    "tpusync.cluster.registry.server and tpusync.cluster.registry.client",
    DeprecationWarning,
    stacklevel=2,
)

_MOVED_TO = (
    tpusync.cluster.registry.server,
    tpusync.cluster.registry.client,
    tpusync.cluster.registry._wire,
    tpusync.cluster.registry.base,
    tpusync.cluster._handshake,
    tpusync.cluster._tcp_server,
    tpusync.errors,
)


def __getattr__(name: str) -> Any:
    for module in _MOVED_TO:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
