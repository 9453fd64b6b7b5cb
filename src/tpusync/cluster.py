"""Across hosts: the registry of who holds which block, the TCP data plane, store nodes, and
serving a KV store to peers.

Registries: :class:`MemoryRegistry` (served by :class:`RegistryServer`, reached through
:class:`RemoteRegistry`), :class:`RedisRegistry` (needs ``tpusync[cluster]``) and
:class:`JaxRegistry` (a ``jax.distributed`` job's coordination service). The data plane:
:class:`BlockServer` serves a pool's blocks, :class:`BlockClient` pulls them under a lease.
:func:`serve` serves a KV store's blocks and lists them in a registry; :class:`RegistryTier`,
:class:`StoreNodeTier` and :class:`PeerTier` are the networked tiers of a store;
:class:`StoreNode` is ``tpusync serve``. The errors are in :mod:`tpusync.errors`."""

from __future__ import annotations

from tpusync._src.cluster.circuit import PeerCircuits
from tpusync._src.cluster.dataplane import (
    BlockClient,
    BlockServer,
    HeldBlocks,
    Lease,
    LeaseTable,
    PullResult,
    RemotePool,
)
from tpusync._src.cluster.probe import ServerHealth, probe_health
from tpusync._src.cluster.registry import (
    Holder,
    JaxRegistry,
    MemoryRegistry,
    NodeInfo,
    RedisRegistry,
    Registry,
    RegistryServer,
    RemoteRegistry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync._src.cluster.registry_link import RegistryLink
from tpusync._src.cluster.registry_pool import RegistryPool
from tpusync._src.cluster.serving import serve
from tpusync._src.cluster.store_node import StoreNode, StoreNodePool, StoreServer
from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync._src.cluster.tcp_server import BlockServerOptions
from tpusync._src.cluster.tier_specs import PeerTier, RegistryTier, StoreNodeTier

__all__ = [
    "BlockClient",
    "BlockServer",
    "BlockServerOptions",
    "HeldBlocks",
    "Holder",
    "JaxRegistry",
    "Lease",
    "LeaseTable",
    "MemoryRegistry",
    "NodeInfo",
    "PeerCircuits",
    "PeerTier",
    "PullResult",
    "RedisRegistry",
    "Registry",
    "RegistryLink",
    "RegistryPool",
    "RegistryServer",
    "RegistryTier",
    "RemotePool",
    "RemoteRegistry",
    "ServerHealth",
    "StoreNode",
    "StoreNodePool",
    "StoreNodeTier",
    "StoreServer",
    "SupervisedLoop",
    "longest_common_prefix",
    "longest_prefix",
    "probe_health",
    "serve",
]
