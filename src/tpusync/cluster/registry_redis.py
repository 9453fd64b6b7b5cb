"""Deprecated: this module moved to
tpusync.cluster.registry.redis
(this path goes in the next release)."""

import warnings
from typing import Any

import tpusync.cluster.registry.redis
import tpusync.errors

warnings.warn(
    "tpusync.cluster.registry_redis is deprecated: import from tpusync.cluster.registry.redis",
    DeprecationWarning,
    stacklevel=2,
)

_MOVED_TO = (
    tpusync.cluster.registry.redis,
    tpusync.errors,
)


def __getattr__(name: str) -> Any:
    for module in _MOVED_TO:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
