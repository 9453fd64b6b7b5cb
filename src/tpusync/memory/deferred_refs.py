"""Views of host memory that JAX's runtime lets go of only at the next garbage collection.

On the CPU backend ``jax.device_put`` of an aligned host array aliases it, and the runtime
drops its reference to the numpy view on a thread without the GIL: the decref waits in a
queue that JAX drains from a ``gc`` callback. Until then the host memory counts as exported
and cannot be unmapped, although nothing uses it. A generation-0 collection runs the callback.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TypeVar

__all__ = ["close_releasing_deferred_views"]

T = TypeVar("T")


def close_releasing_deferred_views(close: Callable[[], T]) -> T:
    """``close()``; where it raises ``BufferError`` (views still alive), lets JAX drop the
    views it only holds until the next collection and tries once more."""
    try:
        return close()
    except BufferError:
        gc.collect(0)  # runs JAX's gc callback, which drains its deferred decrefs
    return close()
