"""Views of host memory that JAX's runtime lets go of only at the next garbage collection.

On the CPU backend ``jax.device_put`` of an aligned host array aliases it, and the runtime
drops its reference to the numpy view on a thread without the GIL: the decref waits in a
queue that JAX drains from a ``gc`` callback. Until then the host memory counts as exported
and cannot be unmapped, although nothing uses it. A generation-0 collection runs the callback.
The runtime's thread may queue that decref a little after the transfer's result is ready (seen
in a loaded test run: the first collection found nothing to drain), so collections are retried
for a short while before the memory counts as still in use.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["SETTLE_S", "close_releasing_deferred_views"]

T = TypeVar("T")


SETTLE_S = 0.2  # how long the runtime's thread may take to queue its decrefs


def close_releasing_deferred_views(close: Callable[[], T]) -> T:
    """``close()``; where it raises ``BufferError`` (views still alive), lets JAX drop the
    views it only holds until the next collection and tries again, for up to
    :data:`SETTLE_S` seconds; then the ``BufferError`` stands (a view someone holds)."""
    try:
        return close()
    except BufferError:
        pass
    deadline = time.monotonic() + SETTLE_S
    pause = 0.0005
    while True:
        gc.collect(0)  # runs JAX's gc callback, which drains its deferred decrefs
        try:
            return close()
        except BufferError:
            if time.monotonic() >= deadline:
                raise
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
