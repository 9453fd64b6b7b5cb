"""Memory tiers below device memory: host DRAM (optionally in /dev/shm), local disk and shared
filesystems. Every tier holds blocks in one slot format (:class:`PoolLayout`); a lower tier is a
:class:`BlockTier` that reads and fills DRAM through a :class:`SlotPool`, opened from a
:class:`TierSpec`. :func:`tpusync.testing.conformance.check_tier` checks a tier of your own."""

from __future__ import annotations

from tpusync._src.tiers.base import BlockTier, LowerTier, SlotPool
from tpusync._src.tiers.disk import DiskPool
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import ArrayLayout, PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.shared_fs import SharedFsPool
from tpusync._src.tiers.slots import Pinned, Reservation
from tpusync._src.tiers.spec import OpenedTier, TierContext, TierSpec
from tpusync._src.tiers.stats import TierStats, all_tier_stats

__all__ = [
    "ArrayLayout",
    "BlockTier",
    "DiskPool",
    "HostPool",
    "LowerTier",
    "OpenedTier",
    "Pinned",
    "PoolLayout",
    "Reservation",
    "Scatter",
    "SharedFsPool",
    "SlotPool",
    "TierContext",
    "TierSpec",
    "TierStats",
    "all_tier_stats",
]
