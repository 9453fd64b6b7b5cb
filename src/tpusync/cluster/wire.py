"""Deprecated: this module moved to
tpusync.cluster.dataplane.wire
(this path goes in the next release)."""

import warnings
from typing import Any

import tpusync.cluster.dataplane.wire

warnings.warn(
    "tpusync.cluster.wire is deprecated: import from tpusync.cluster.dataplane.wire",
    DeprecationWarning,
    stacklevel=2,
)

_MOVED_TO = (tpusync.cluster.dataplane.wire,)


def __getattr__(name: str) -> Any:
    for module in _MOVED_TO:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
