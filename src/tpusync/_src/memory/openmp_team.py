"""Copies on the caller's OpenMP team: for processes whose compute runs on OpenMP (PyTorch's CPU
operators, vLLM on CPU).

After each parallel region an OpenMP runtime keeps its workers spinning on their cores for a
while, waiting for the next one. A copy that runs on tpusync's own threads right after a model
step then shares each core with a spinning worker, and runs at a fraction of its rate
(docs/decisions/0009-copies-on-the-openmp-team.md). Inside :func:`openmp_team`, the copy
engine's parallel jobs of the calling thread run as one parallel region of that thread's own
OpenMP team instead, on the very workers that were spinning.

Only the thread that runs the model's operators owns that team (the runtime keeps one team per
thread that starts parallel regions): use it there, around a copy the model waits for.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

from tpusync._native import core as _core

__all__ = ["openmp_runtime_loaded", "openmp_team"]

# GNU's OpenMP ABI: libgomp exports these, and so do LLVM's and Intel's runtimes
_ENTRY_POINTS = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
_install_lock = threading.Lock()


def _find_runtime() -> tuple[int, int, int] | None:
    """The addresses of the OpenMP runtime's entry points among the libraries loaded into the
    process's global scope (where PyTorch loads its runtime), or None."""
    try:
        process = ctypes.CDLL(None)
        return tuple(  # type: ignore[return-value]
            ctypes.cast(getattr(process, name), ctypes.c_void_p).value for name in _ENTRY_POINTS
        )
    except (AttributeError, OSError):
        return None


def openmp_runtime_loaded() -> bool:
    """Whether an OpenMP runtime is loaded (and handed to the copy engine, once)."""
    if _core.openmp_installed():
        return True
    with _install_lock:
        if _core.openmp_installed():
            return True
        found = _find_runtime()
        if found is None or not all(found):
            return False
        _core.openmp_install(*found)
        return True


@contextlib.contextmanager
def openmp_team() -> Iterator[bool]:
    """Within it, this thread's parallel copies run on its OpenMP team; yields whether they do
    (False where no OpenMP runtime is loaded: the copy engine's own threads run them)."""
    if not openmp_runtime_loaded():
        yield False
        return
    previous = _core.openmp_here(True)
    try:
        yield True
    finally:
        _core.openmp_here(previous)
