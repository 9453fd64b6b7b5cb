"""Huge pages behind CPU device pools and /dev/shm host pools, collapsed in the background.

On the CPU backend a DevicePool's buffers are host memory that XLA allocated in 4 KiB pages;
a named HostPool's file lives in a tmpfs that allocates 4 KiB pages unless mounted with huge=.
Block copies into and out of them scatter small pieces over hundreds of MiB, so every piece
misses the TLB; with the pages collapsed to 2 MiB they copy nearly as fast as ``np.copyto``
(whose numpy arrays get huge pages; figures in docs/decisions/0007).

Collapsing costs CPU time for every MiB (the kernel copies the pages), so it runs on one daemon
thread, a chunk per call, after the pool is created. It never changes a byte (the kernel keeps the
contents and makes concurrent writers wait), so it needs no lock: a buffer freed meanwhile only
makes the call fail or collapse memory that some other allocation now uses, harmlessly.
``Options.huge_pages`` (:mod:`tpusync.options`; ``TPUSYNC_HUGE_PAGES=0``) turns it off.
"""

from __future__ import annotations

import logging
import os
import queue
import threading

import jax

from tpusync import options
from tpusync._native import core as _core

log = logging.getLogger("tpusync")

_HUGE = 2 << 20
_CHUNK = 32 << 20  # per native call, whole huge pages: the worker stops promptly at exit
_queue: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_lock = threading.Lock()
_idle = threading.Condition(_lock)
_pending = 0  # buffers queued or being collapsed
collapsed_bytes = 0  # what the worker collapsed so far in this process (for info and tests)


def enabled() -> bool:
    """Whether pools are collapsed into huge pages (the process's options say)."""
    return options.current().huge_pages


def collapse_later(array: jax.Array) -> None:
    """Queues the host buffers of a CPU array's shards for collapsing into huge pages."""
    if not enabled():
        return
    ranges = []
    for shard in array.addressable_shards:
        if shard.device.platform != "cpu":
            return
        data = shard.data
        ranges.append((data.unsafe_buffer_pointer(), data.nbytes))
    _enqueue(ranges)


def collapse_range_later(address: int, length: int) -> None:
    """Queues a mapping's range (e.g. a /dev/shm pool's, whose tmpfs allocates only small
    pages unless mounted with ``huge=``) for collapsing into huge pages. The huge pages stay in
    the file's page cache: a process that re-attaches the pool maps them as they are."""
    if enabled():
        _enqueue([(address, length)])


def _enqueue(ranges: list[tuple[int, int]]) -> None:
    global _worker, _pending
    with _lock:
        for item in ranges:
            if item[1] >= _HUGE:  # smaller buffers hold no whole huge page
                _queue.put(item)
                _pending += 1
        if _worker is None or not _worker.is_alive():
            _worker = threading.Thread(
                target=_collapse_loop, name="tpusync-huge-pages", daemon=True
            )
            _worker.start()


def wait_until_idle(timeout_s: float | None = None) -> bool:
    """Waits until every buffer queued so far is collapsed (benchmarks settle on it before
    timing); False on timeout."""
    with _idle:
        return _idle.wait_for(lambda: _pending == 0, timeout=timeout_s)


def _collapse_loop() -> None:
    global collapsed_bytes, _pending
    while True:
        address, length = _queue.get()
        try:
            first = -(-address // _HUGE) * _HUGE  # chunks of whole huge pages: none is split
            for start in range(first, address + length, _CHUNK):
                done = _core.collapse_huge_pages(start, min(_CHUNK, address + length - start))
                if done < 0:  # refused (old kernel, THP off): advice only, nothing to undo
                    log.debug("tpusync: huge pages refused for a pool buffer (errno %d)", -done)
                    break
                collapsed_bytes += done
        finally:
            with _idle:
                _pending -= 1
                _idle.notify_all()


def _forget_worker_after_fork() -> None:
    global _worker, _queue, _lock, _idle, _pending
    _worker = None
    _queue = queue.SimpleQueue()
    _lock = threading.Lock()
    _idle = threading.Condition(_lock)
    _pending = 0


os.register_at_fork(after_in_child=_forget_worker_after_fork)
