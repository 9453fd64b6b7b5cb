"""The local-SSD tier: :class:`DiskPool` (slab files, direct I/O, an index that survives
restarts), and :func:`check_disk_capacity`, the sizes it refuses before allocating anything."""

from tpusync._src.tiers.disk.pool import DiskPool, check_disk_capacity

__all__ = ["DiskPool", "check_disk_capacity"]
