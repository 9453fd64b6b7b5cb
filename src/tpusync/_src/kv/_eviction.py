"""Which block a tier gives up first: the eviction order, one policy object per tier.

A policy only orders a tier's keys. What may be evicted (pins, sessions' blocks, blocks being
written down) and what becomes of a victim (demoted, written back, dropped) is the tier stack's
(:mod:`tpusync._src.kv._tier_stack`), which calls a policy under its lock."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

__all__ = ["EvictionPolicy", "LruPolicy"]


class EvictionPolicy(Protocol):
    """The order in which one tier's blocks are evicted."""

    def touched(self, keys: Sequence[bytes]) -> None:
        """``keys`` were stored in the tier or hit there (a key new to the policy enters)."""

    def removed(self, keys: Iterable[bytes]) -> None:
        """``keys`` left the tier (keys it does not know are ignored)."""

    def coldest(self) -> Iterator[bytes]:
        """The tier's keys, the first to evict first."""


class LruPolicy:
    """Least recently used first: a store or a hit moves a key to the hot end."""

    def __init__(self, keys: Iterable[bytes] = ()) -> None:
        self._order: collections.OrderedDict[bytes, None] = collections.OrderedDict.fromkeys(keys)

    def touched(self, keys: Sequence[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            try:
                move(key)
            except KeyError:  # new here: enters at the hot end
                order[key] = None

    def removed(self, keys: Iterable[bytes]) -> None:
        pop = self._order.pop
        for key in keys:
            pop(key, None)

    def coldest(self) -> Iterator[bytes]:
        return iter(self._order)
