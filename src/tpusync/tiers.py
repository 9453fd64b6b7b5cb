"""Memory tiers below device memory: host DRAM (optionally in /dev/shm), local disk and shared
filesystems. Every tier holds blocks in one slot format (:class:`PoolLayout`); a lower tier is a
:class:`BlockTier` that reads and fills DRAM through a :class:`SlotPool`, opened from a
:class:`TierSpec`. :func:`tpusync.testing.conformance.check_tier` checks a tier of your own."""

from __future__ import annotations

from tpusync._src.tiers import (
    ArrayLayout,
    BlockTier,
    DiskPool,
    HostPool,
    LowerTier,
    OpenedTier,
    Pinned,
    PoolLayout,
    Reservation,
    Scatter,
    SharedFsPool,
    SlotPool,
    TierContext,
    TierSpec,
    TierStats,
    all_tier_stats,
)

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
