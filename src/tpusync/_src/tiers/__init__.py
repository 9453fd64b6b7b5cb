"""Memory tiers below device memory: host DRAM (optionally in /dev/shm), local disk and shared
filesystems. Every tier holds blocks in the same slot format (:class:`PoolLayout`); the block
transaction lives once in :class:`BlockTier` (``tiers/base.py``, with :class:`SlotPool`, what a
lower tier needs of a DRAM pool), each medium in its own subpackage (``dram/``, ``disk/``,
``shared_fs/``)."""
