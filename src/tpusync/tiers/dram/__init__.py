"""The DRAM tier: :class:`HostPool` (page-aligned slots in anonymous memory or in /dev/shm, a
records index that survives the process), the handles of its slot interface
(:class:`Reservation`, :class:`Pinned`), the locks of the device pools a move holds
(:class:`PoolLocks`), where named pools live (:func:`pool_path`; their sessions:
:func:`sessions_path`) and how large a pool is (:func:`pool_bytes`)."""

from tpusync.tiers._pool_open import pool_bytes
from tpusync.tiers._shm_files import DEFAULT_SHM_DIR, pool_path, sessions_path
from tpusync.tiers.dram._device_moves import PoolLocks
from tpusync.tiers.dram.pool import HostPool
from tpusync.tiers.dram.slots import Pinned, Reservation

__all__ = [
    "DEFAULT_SHM_DIR",
    "HostPool",
    "Pinned",
    "PoolLocks",
    "Reservation",
    "pool_bytes",
    "pool_path",
    "sessions_path",
]
