"""Host memory that tpusync allocated, offered for DMA registration with accelerator plugins.

A ``HostBuffer`` or ``HostPool`` offers its mapping here when it is made; an engine that can
register host memory for DMA (the PJRT engine's ``PJRT_Client_DmaMap``) reads the offered
ranges on first use and subscribes to their unmapping (:func:`on_unmap`), so that every
registration is undone before the memory goes. Memory knows nothing of the engines: they come
to it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["offer_for_dma", "offered", "offered_between", "on_unmap"]

_ranges: dict[int, int] = {}  # start -> size
# re-entrant: a Mapping collected by the garbage collector while a thread holds the lock
# unmaps itself on that same thread
_lock = threading.RLock()
_listeners: list[Callable[[int], None]] = []


def offer_for_dma(mapping: Any) -> None:
    """Marks a ``_core.Mapping`` as worth registering for DMA, on first use by an engine that
    offers it; every listener of :func:`on_unmap` hears of it before it is unmapped."""
    start, size = int(mapping.address), int(mapping.size)
    if not start:
        return
    with _lock:
        _ranges[start] = size
    mapping.on_unmap = _unmapping


def on_unmap(listener: Callable[[int], None]) -> None:
    """Calls ``listener(start)`` before an offered range is unmapped (it must never raise)."""
    with _lock:
        _listeners.append(listener)


def offered() -> bool:
    """Whether any range is offered now (a cheap check before :func:`offered_between`)."""
    return bool(_ranges)


def offered_between(lo: int, hi: int) -> list[tuple[int, int]]:
    """The offered (start, size) ranges meeting [lo, hi)."""
    with _lock:
        return [(s, n) for s, n in _ranges.items() if s < hi and s + n > lo]


def _unmapping(start: int, size: int) -> None:
    with _lock:
        _ranges.pop(start, None)
        listeners = list(_listeners)
    for listener in listeners:
        listener(start)


def _forget_lock_after_fork() -> None:
    # a thread gone with the fork may hold it; the ranges stay offered (the memory is mapped)
    global _lock
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_lock_after_fork)
