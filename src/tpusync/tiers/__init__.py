"""Memory tiers below device memory: host DRAM (optionally in /dev/shm), and (to come) local disk
and shared filesystems. Every tier holds blocks in the same slot format (:class:`PoolLayout`)."""

from tpusync.tiers.base import LowerTier
from tpusync.tiers.disk_pool import DiskPool
from tpusync.tiers.host_pool import HostPool, Pinned, Reservation
from tpusync.tiers.layout import ArrayLayout, PoolLayout
from tpusync.tiers.shared_fs_pool import SharedFsPool
from tpusync.tiers.stats import TierStats, all_tier_stats

__all__ = [
    "ArrayLayout",
    "DiskPool",
    "HostPool",
    "LowerTier",
    "Pinned",
    "PoolLayout",
    "Reservation",
    "SharedFsPool",
    "TierStats",
    "all_tier_stats",
]
