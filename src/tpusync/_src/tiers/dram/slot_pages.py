"""Which slots of a mapped pool have their pages mapped in this process, and mapping the rest
one call per run of neighbouring slots: a copy that touched unmapped pages would take a fault
per page (64 KiB of a tmpfs file per fault), on its own critical path. A host pool and a reader
of another process's pool file (same-host pulls) both keep one."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["SlotPages"]


class SlotPages:
    """Per slot: whether its pages are mapped here.

    Args:
      n_slots, slot_bytes, data_offset: where the slots lie in the mapping.
      map_range: maps ``(offset, length)`` bytes of the mapping (e.g. ``madvise`` with
        ``MADV_POPULATE_READ``); an error it raises reaches the caller of :meth:`ensure`.
      mapped: whether every slot starts mapped (a pool that populated its pages at creation).
    """

    def __init__(
        self,
        n_slots: int,
        slot_bytes: int,
        data_offset: int,
        map_range: Callable[[int, int], None],
        *,
        mapped: bool = False,
    ) -> None:
        self.slot_bytes = slot_bytes
        self.data_offset = data_offset
        self._map_range = map_range
        self._mapped = np.full(n_slots, mapped, dtype=bool)
        self.all_mapped = bool(self._mapped.all())  # then a copy need not look

    def ensure(self, slots: np.ndarray, tail_bytes: int | None = None) -> None:
        """Maps the pages of ``slots`` not mapped yet, one call per run of neighbouring slots;
        a run's last slot up to ``tail_bytes`` (default: the whole slot; a reader maps only
        the payload it copies)."""
        if self.all_mapped:
            return
        todo = slots[~self._mapped[slots]]
        if not len(todo):
            return
        todo = np.unique(todo)
        tail = self.slot_bytes if tail_bytes is None else tail_bytes
        for run in np.split(todo, np.flatnonzero(np.diff(todo) != 1) + 1):
            start = self.data_offset + int(run[0]) * self.slot_bytes
            self._map_range(start, (len(run) - 1) * self.slot_bytes + tail)
        self._mapped[todo] = True
        self.all_mapped = bool(self._mapped.all())

    def steps(self, step_bytes: int, max_bytes: int | None = None) -> Iterator[np.ndarray]:
        """The slots in order, about ``step_bytes`` of them at a time, up to ``max_bytes`` (all
        by default): a background walk maps one step at a time, letting other work in between."""
        n = len(self._mapped)
        per_step = max(1, step_bytes // self.slot_bytes)
        end = n if max_bytes is None else min(n, max(1, max_bytes // self.slot_bytes))
        for first in range(0, end, per_step):
            yield np.arange(first, min(first + per_step, end), dtype=np.int64)
