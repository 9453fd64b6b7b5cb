"""Touching every page of a new host pool once, with a progress report for large pools."""

from __future__ import annotations

from tpusync._native import core as _core
from tpusync._src.memory.progress import Progress

__all__ = ["PROGRESS_MIN_BYTES", "prefault"]

PROGRESS_MIN_BYTES = 1 << 30  # pools smaller than this prefault silently (under a second)
_PREFAULT_STEP = 64 << 20


def prefault(mapping: _core.Mapping, label: str) -> None:
    """Touches every page once, with a progress report for large pools."""
    if mapping.size < PROGRESS_MIN_BYTES:
        mapping.populate()
        return
    with Progress(label, mapping.size) as progress:
        for start in range(0, mapping.size, _PREFAULT_STEP):
            length = min(_PREFAULT_STEP, mapping.size - start)
            mapping.populate(start, length)
            progress.advance(length)
