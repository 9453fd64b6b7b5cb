"""Deprecated path: the disk tier moved to :mod:`tpusync.tiers.disk` (``tpusync.tiers.DiskPool``
is unchanged). This module re-exports it for one release."""

import warnings

from tpusync.tiers.disk.pool import HEADER_BYTES, DiskPool

__all__ = ["HEADER_BYTES", "DiskPool"]

warnings.warn(
    "tpusync.tiers.disk_pool is deprecated (removed in the next release): use "
    "tpusync.tiers.DiskPool, or tpusync.tiers.disk",
    DeprecationWarning,
    stacklevel=2,
)
