"""Deprecated: this module moved to
tpusync.cluster.registry.jax
(this path goes in the next release)."""

import warnings
from typing import Any

import tpusync.cluster.registry.jax

warnings.warn(
    "tpusync.cluster.registry_jax is deprecated: import from tpusync.cluster.registry.jax",
    DeprecationWarning,
    stacklevel=2,
)

_MOVED_TO = (tpusync.cluster.registry.jax,)


def __getattr__(name: str) -> Any:
    for module in _MOVED_TO:
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
