"""SGLang's real cache controller, built around a host pool and a storage backend without the
GPU device pool its constructor needs: what the tests and the HiCache benchmark drive the
storage calls through. Imports SGLang: use it only where SGLang is installed."""

from __future__ import annotations

import queue
from typing import Any

from sglang.srt.managers.cache_controller import HiCacheController

__all__ = ["controller"]


def controller(backend: Any, pool: Any, *, zero_copy: bool) -> HiCacheController:
    """SGLang's ``HiCacheController`` with only what its storage calls read: the backend, the
    host pool, the page size, the queue of prefetch acks, and the page functions it picks for
    ``interface_v1`` (``zero_copy``) or the generic interface."""
    made = object.__new__(HiCacheController)
    made.storage_backend = backend
    made.storage_host_pool = pool
    made.mem_pool_host = pool
    made.page_size = pool.page_size
    made.prefetch_sync_queue = queue.Queue()
    if zero_copy:
        made.page_get_func, made.page_set_func = made._page_get_zero_copy, made._page_set_zero_copy
    else:
        made.page_get_func, made.page_set_func = made._generic_page_get, made._generic_page_set
    return made
