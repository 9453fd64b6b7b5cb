"""The interpreter's GIL switch interval while a connector's store is open.

An engine that runs its loop in the worker's process (vLLM's in-process engine core, or its
busy-polling threads) holds the GIL whenever it can; every time a background load of ours
returns from a socket or a native copy it waits for the GIL, and Python hands it over only
every switch interval (5 ms by default). A pull of a few dozen Python steps then waits that
interval at each of them (figures: docs/connectors/vllm.md, "Measured"). A shorter interval costs
nothing while only one thread wants the GIL, so the connector shortens it for as long as any
of its stores in the process is open, and puts the interpreter's own value back after the
last one closes."""

from __future__ import annotations

import sys
import threading

__all__ = ["hold", "release"]

_lock = threading.Lock()
_holders = 0
_original: float | None = None


def hold(interval_s: float) -> None:
    """Sets the switch interval to ``interval_s`` (the shortest any holder asked for wins)."""
    global _holders, _original
    with _lock:
        if _holders == 0:
            _original = sys.getswitchinterval()
        _holders += 1
        sys.setswitchinterval(min(interval_s, sys.getswitchinterval()))


def release() -> None:
    """Drops one hold; the last one puts the interpreter's own interval back."""
    global _holders, _original
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0 and _original is not None:
            sys.setswitchinterval(_original)
            _original = None
