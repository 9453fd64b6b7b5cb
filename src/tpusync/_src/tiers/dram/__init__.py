"""The DRAM tier, all of it in this folder: :class:`HostPool` (page-aligned slots in anonymous
memory or in /dev/shm, a records index that survives the process; it implements the slot
interface the lower tiers use, :class:`~tpusync._src.tiers.base.SlotPool`, and moves blocks
between device pools and its slots through :class:`~tpusync._src.transfer.slot_moves.SlotMover`),
where named pools live (:func:`pool_path`; their
sessions: :func:`sessions_path`), how large a pool is (:func:`pool_bytes`), and its records'
format (:data:`RECORD_DTYPE` and the states :data:`FREE`, :data:`WRITING`, :data:`COMMITTED`),
which the disk tier's slab files share.

Inside: the pool file's format (``pool_file``), opening and creating it (``_pool_open``), the
files a named pool keeps in /dev/shm (``_shm_files``), the pages of slots a process has mapped
(:mod:`~tpusync._src.tiers.dram.slot_pages`) and ``tpusync shm``'s listing and removal of pools
(:mod:`~tpusync._src.tiers.dram.shm_admin`)."""

from tpusync._src.tiers.dram._pool_open import pool_bytes
from tpusync._src.tiers.dram._shm_files import DEFAULT_SHM_DIR, pool_path, sessions_path
from tpusync._src.tiers.dram.pool import HostPool
from tpusync._src.tiers.dram.pool_file import COMMITTED, FREE, RECORD_DTYPE, WRITING

__all__ = [
    "COMMITTED",
    "DEFAULT_SHM_DIR",
    "FREE",
    "RECORD_DTYPE",
    "WRITING",
    "HostPool",
    "pool_bytes",
    "pool_path",
    "sessions_path",
]
