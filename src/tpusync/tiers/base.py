"""The block interface every tier below DRAM implements (disk, shared filesystem, remote, and
another DRAM pool: :class:`~tpusync.tiers.HostPool` implements it slot to slot).

Blocks move between such a tier and the DRAM tier (:class:`~tpusync.tiers.HostPool`) slot to
slot: ``put`` reads committed DRAM slots (pinned while read) and stores them with their key,
layout fingerprint, length and checksum; ``get`` reserves DRAM slots, reads into them straight
from the medium, verifies every block's checksum over the bytes read, and commits only the good
ones. A block that is absent or fails verification is a miss: ``get`` raises
:class:`~tpusync.errors.BlocksMissingError` with a ``loaded`` mask after committing the rest.

A tier may also answer ``free`` (blocks it can still take now) and ``usable_capacity`` (the
slots it can reach now, when that is less than ``capacity``: a disk tier whose filesystem has no
room for more slab files); the KV store's tier stack evicts by them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from tpusync.tiers.host_pool import HostPool
from tpusync.tiers.layout import PoolLayout
from tpusync.tiers.stats import TierStats

__all__ = ["LowerTier"]


@runtime_checkable
class LowerTier(Protocol):
    layout: PoolLayout
    stats: TierStats

    @property
    def capacity(self) -> int:
        """Blocks the tier can hold."""
        ...

    @property
    def used(self) -> int:
        """Blocks the tier holds."""
        ...

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        """Stores the DRAM blocks under ``keys``; returns how many were written (keys already
        stored are skipped; keys absent from ``source`` raise ``BlocksMissingError``)."""
        ...

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Loads the blocks under ``keys`` into ``target`` (see the module docstring)."""
        ...

    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> int: ...

    def keys(self) -> list[bytes]: ...

    def close(self) -> None: ...
