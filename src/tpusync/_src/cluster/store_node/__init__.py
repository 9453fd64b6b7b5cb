"""Store nodes: a process that lends its DRAM to other nodes as a lower tier (`tpusync serve`).

:class:`StoreServer` is a :class:`~tpusync.cluster.BlockServer` that holds one HostPool per
block layout, made when the first client names that layout in its hello, and that also accepts
blocks (``put``). Peers reach it through :class:`StoreNodePool`, a writable lower tier: a store
opens one for its spec ``KVStoreConfig(tiers=(StoreNodeTier(...),))``
(:class:`~tpusync.cluster.StoreNodeTier`), and the store's DRAM writes through to the node and
demotes its victims there, and loads promote from it.

The extra requests (after the data plane's, see :mod:`tpusync._src.cluster.dataplane`)::

    hello    {..., "layout": PoolLayout.describe()}  the layout this connection moves
    put      {"keys": [hex, ...], "checksums": [int, ...]}
             -> {"accept": [bool, ...], "present": [bool, ...]}, then the client sends a BLOCK
             frame for every accepted key, in order, then END -> {"stored": [bool, ...]}
    delete   {"keys": [hex, ...]}                  -> blocks dropped
    keys     {"start": i, "limit": n}              -> [hex, ...] (n <= 4096)

A put reserves a slot per accepted key (the node evicts its least recently used unpinned
blocks to make room: it is a cache, the peers' DRAM is where blocks are born), receives each
payload straight into its slot, verifies it (the frame's checksum equals the declared one and
the checksum of the received bytes) and commits only verified, complete blocks; a connection cut
mid-put commits none of the blocks still in flight.

:class:`StoreNode` runs a StoreServer and, optionally, an embedded registry (a
:class:`~tpusync.cluster.RegistryServer` over a MemoryRegistry) and the registry link that
publishes every block the node holds, so that :class:`~tpusync.cluster.RegistryPool` readers on
other hosts find them too. With ``name``, the node's pools live in /dev/shm and a restarted
node re-attaches them and publishes their blocks again.

Sessions' blocks that a store demoted to a node can be evicted there like any block: keep
sessions on a disk tier when they must survive.
"""

from tpusync._src.cluster.store_node.node import StoreNode
from tpusync._src.cluster.store_node.pool import StoreNodePool
from tpusync._src.cluster.store_node.server import StoreServer

__all__ = ["StoreNode", "StoreNodePool", "StoreServer"]
