"""The open lookup handles of a :class:`~tpusync.kv.KVCacheStore`, each watched for being dropped.

A :class:`~tpusync.kv.LookupResult` pins its blocks until :meth:`~tpusync.kv.KVCacheStore.load`
or :meth:`~tpusync.kv.KVCacheStore.release` consumes it. One that is garbage collected unconsumed
would keep its pins forever; like an unclosed file, it warns (:class:`ResourceWarning`) and its
pins are released.

How, safely: the store keeps no strong reference to a handle, only a :class:`weakref.finalize`
per handle, whose callback holds the handle's id and keys (never the handle: no resurrection).
The callback may run in any thread, at any allocation (the cyclic GC), perhaps while that thread
holds the store's locks; so it takes no lock and does no I/O: it queues the handle's id (a deque
append is atomic) and warns. The store drops the pins of the queued handles at the start of its
next call (:meth:`OpenHandles.take_dropped`, with the store's handle lock held), so no call of
the store sees them. Finalizers do not run at interpreter exit (``atexit = False``): the
process's pins end with it.
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque

from tpusync._src.kv.results import LookupResult, handle_id, handle_state, set_handle_state

__all__ = ["OpenHandles"]


class OpenHandles:
    """The handles :meth:`~tpusync.kv.KVCacheStore.lookup` gave out and nothing consumed yet.
    Call every method with the store's handle lock held."""

    def __init__(self) -> None:
        self._watched: dict[int, weakref.finalize] = {}
        self._dropped: deque[int] = deque()  # ids of handles collected unconsumed
        self._keys: dict[int, tuple[bytes, ...]] = {}  # the pinned keys of each handle

    def __len__(self) -> int:
        return len(self._watched) - len(self._dropped)

    @property
    def dropped(self) -> bool:
        """Whether handles were collected unconsumed since :meth:`take_dropped` (no lock
        needed: a hint that :meth:`take_dropped` has work)."""
        return bool(self._dropped)

    def add(self, result: LookupResult) -> None:
        """Watches a new handle."""
        self._keys[handle_id(result)] = result.keys
        watcher = weakref.finalize(
            result,
            _collected,
            self._dropped,
            handle_id(result),
            len(result.keys),
            result.cached_tokens,
            result.total_tokens,
        )
        watcher.atexit = False
        self._watched[handle_id(result)] = watcher

    def remove(self, result: LookupResult) -> None:
        """Stops watching a handle that was loaded or released (its pins are the caller's to
        drop)."""
        watcher = self._watched.pop(handle_id(result), None)
        self._keys.pop(handle_id(result), None)
        if watcher is not None:
            watcher.detach()

    def take_dropped(self) -> list[bytes]:
        """The keys whose pins handles collected unconsumed still hold (one entry per pin),
        forgetting those handles."""
        keys: list[bytes] = []
        while self._dropped:
            number = self._dropped.popleft()
            self._watched.pop(number, None)
            keys.extend(self._keys.pop(number, ()))
        return keys

    def close(self) -> tuple[list[bytes], int]:
        """Invalidates every handle still alive and not consumed (the store is closing) and
        stops watching all. Returns the keys whose pins they held, collected ones included (one
        entry per pin), and how many live handles held pins."""
        keys = self.take_dropped()
        holding = 0
        for number, watcher in self._watched.items():
            found = watcher.detach()  # None: collected meanwhile (its pins are still held)
            if found is not None:
                handle: LookupResult = found[0]
                holding += handle_state(handle) == "open" and bool(handle.keys)
                set_handle_state(handle, "closed")
            keys.extend(self._keys.get(number, ()))
        self._watched.clear()
        self._keys.clear()
        self._dropped.clear()
        return keys, holding


def warn_still_open(holding: int) -> None:
    """The warning of :meth:`~tpusync.kv.KVCacheStore.close` for handles that still held pins."""
    if holding:
        warnings.warn(
            f"KVCacheStore.close(): {holding} lookup handle{'s' if holding > 1 else ''} still "
            "open (never loaded or released); their pins are released now. Release each handle "
            "(store.release(handle), or `with store.lookup(tokens) as handle:`) before closing "
            "the store",
            ResourceWarning,
            stacklevel=4,  # the caller of KVCacheStore.close
        )


def _collected(
    dropped: deque[int], number: int, blocks: int, cached_tokens: int, total_tokens: int
) -> None:
    """A handle was garbage collected without load() or release(): its pins are queued for the
    store to drop, and it warns (no lock, no I/O here: see the module docstring)."""
    dropped.append(number)
    if blocks:  # a miss pins nothing: dropping it is fine
        warnings.warn(
            f"a KVCacheStore lookup handle was never loaded or released (a hit of {blocks} "
            f"blocks, {cached_tokens} of {total_tokens} tokens); its pins are released. "
            "Call store.release(handle) or store.load(handle, ...), or use it as a context "
            "manager: `with store.lookup(tokens) as handle:`",
            ResourceWarning,
            stacklevel=1,
        )
