"""Whether this process was forked after JAX started there: then device calls are refused.

JAX is not fork-safe: a child of ``fork()`` inherits its runtime's state but none of its
threads, and the first device call hangs. Host memory, the host tiers and the copy engine do
survive (they start fresh threads in the child: see ``copy_engine.c`` and the at-fork handlers
of the modules that own threads), so only device-side calls check :func:`check_device_use`.
"""

from __future__ import annotations

import os
import sys

from tpusync.errors import JaxForkError, PoolBusyError

# The pid of the process this one was forked from after JAX had started there; None while
# JAX is usable here. Hot paths read it before calling check_device_use.
jax_forked_from: int | None = None


def _jax_started() -> bool:
    """Whether JAX started (or was starting) a backend in this process. Read without JAX's
    lock, on purpose: in a child, a thread that held it at the fork is gone."""
    bridge = sys.modules.get("jax._src.xla_bridge")
    if bridge is None:
        return False
    # the handler flag is set as the first backend starts, before _backends fills
    return bool(getattr(bridge, "_backends", None)) or bool(
        getattr(bridge, "_at_fork_handler_installed", False)
    )


def _note_fork_in_child() -> None:
    global jax_forked_from
    if jax_forked_from is None and _jax_started():
        jax_forked_from = os.getppid()


os.register_at_fork(after_in_child=_note_fork_in_child)


def check_device_use(argument: str) -> None:
    """Raises :class:`~tpusync.errors.JaxForkError` (naming ``argument``) when this process
    was forked after JAX had started: a device call here would hang."""
    if jax_forked_from is not None:
        raise JaxForkError(
            f"{argument}: this process was forked (os.fork(), or multiprocessing's 'fork' start "
            f"method) from process {jax_forked_from} after JAX had started there, and JAX does "
            "not survive a fork (a device call would hang). Start the child with "
            "multiprocessing.get_context('spawn') or 'forkserver', or move device arrays in the "
            "parent; host memory (numpy, HostBuffer, HostPool, DiskPool) works in a forked child"
        )


def check_same_process(opened_by: int, what: str) -> None:
    """Raises :class:`~tpusync.errors.PoolBusyError` when called in a forked child of the
    process (``opened_by``) that opened ``what``: its I/O threads do not exist here (a call
    would wait for them forever) and its files belong to the parent."""
    if os.getpid() != opened_by:
        raise PoolBusyError(
            f"{what} was opened by process {opened_by}, and this process ({os.getpid()}) is a "
            "fork of it: its I/O threads and its files' ownership stayed with the parent. Open "
            "a new one in this process (after the parent closed its own), or start children "
            "with multiprocessing.get_context('spawn')"
        )
