"""The shared-filesystem tier: :class:`SharedFsPool` (one content-addressed file per block in a
directory many hosts share)."""

from tpusync._src.tiers.shared_fs.pool import SharedFsPool

__all__ = ["SharedFsPool"]
