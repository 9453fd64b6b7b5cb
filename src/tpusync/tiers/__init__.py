"""Memory tiers below device memory: host DRAM (optionally in /dev/shm), local disk and shared
filesystems. Every tier holds blocks in the same slot format (:class:`PoolLayout`); the block
transaction lives once in :class:`BlockTier` (``tiers/base.py``, with :class:`SlotPool`, what a
lower tier needs of a DRAM pool), each medium in its own subpackage (``dram/``, ``disk/``,
``shared_fs/``)."""

from tpusync.tiers.base import BlockTier, LowerTier, SlotPool
from tpusync.tiers.disk import DiskPool
from tpusync.tiers.dram import HostPool
from tpusync.tiers.layout import ArrayLayout, PoolLayout
from tpusync.tiers.scatter import Scatter
from tpusync.tiers.shared_fs import SharedFsPool
from tpusync.tiers.slots import Pinned, Reservation
from tpusync.tiers.spec import OpenedTier, TierContext, TierSpec
from tpusync.tiers.stats import TierStats, all_tier_stats

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
