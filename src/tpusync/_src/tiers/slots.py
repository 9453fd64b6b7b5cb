"""What a caller of a slot pool's interface (:class:`~tpusync._src.tiers.base.SlotPool`, which
:class:`~tpusync.tiers.HostPool` implements) holds: the slots it reserved
(:class:`Reservation`, to commit or abort) or pinned (:class:`Pinned`, to unpin). Plain data,
shared by the pool and the tiers that move blocks to and from it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Pinned", "Reservation"]


@dataclass(frozen=True)
class Reservation:
    """Slots taken by :meth:`SlotPool.reserve`: ``keys[i]`` (the request's entry
    ``indices[i]``) goes to ``slots[i]``."""

    keys: list[bytes]
    indices: np.ndarray
    slots: np.ndarray

    def subset(self, mask: np.ndarray | Sequence[bool]) -> Reservation:
        """The part of this reservation where ``mask`` is true (to commit or abort apart)."""
        picked = np.flatnonzero(np.asarray(mask, dtype=bool))
        return Reservation(
            [self.keys[i] for i in picked.tolist()], self.indices[picked], self.slots[picked]
        )


@dataclass(frozen=True)
class Pinned:
    """Slots pinned by :meth:`SlotPool.pin`: ``slots[i]`` is -1 where ``keys[i]`` is absent."""

    keys: list[bytes]
    slots: np.ndarray
    present: np.ndarray
    checksums: np.ndarray
    all_present: bool = False
