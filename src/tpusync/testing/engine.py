"""A minimal serving loop of the test model over a KV cache store: :class:`ToyEngine`."""

from __future__ import annotations

from tpusync._src.testing.engine import (
    Request,
    ToyEngine,
)

__all__ = [
    "Request",
    "ToyEngine",
]
