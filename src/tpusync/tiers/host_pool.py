"""Deprecated path: the DRAM tier moved to :mod:`tpusync.tiers.dram` (``tpusync.tiers.HostPool``,
``Pinned`` and ``Reservation`` are unchanged). This module re-exports it for one release."""

import warnings

from tpusync.tiers.dram import DEFAULT_SHM_DIR, HostPool, Pinned, Reservation, pool_path
from tpusync.tiers.dram._device_moves import num_blocks
from tpusync.tiers.dram._prefault import PROGRESS_MIN_BYTES

__all__ = [
    "DEFAULT_SHM_DIR",
    "PROGRESS_MIN_BYTES",
    "HostPool",
    "Pinned",
    "Reservation",
    "num_blocks",
    "pool_path",
]

warnings.warn(
    "tpusync.tiers.host_pool is deprecated (removed in the next release): use "
    "tpusync.tiers.HostPool, or tpusync.tiers.dram",
    DeprecationWarning,
    stacklevel=2,
)
