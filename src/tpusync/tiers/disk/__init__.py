"""The local-SSD tier: :class:`DiskPool` (slab files, direct I/O, an index that survives
restarts)."""

from tpusync.tiers.disk.pool import DiskPool

__all__ = ["DiskPool"]
