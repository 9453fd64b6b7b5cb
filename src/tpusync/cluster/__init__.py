"""Across hosts: the registry of who holds which block, leases, the TCP data plane, store nodes.

Registry backends: :class:`MemoryRegistry` (embedded; serve it to other processes with
:class:`RegistryServer`, reach it with :class:`RemoteRegistry`), :class:`RedisRegistry` (Redis or
Valkey; needs ``tpusync[cluster]``) and :class:`JaxRegistry` (the coordination service of a
``jax.distributed`` job).

Data plane: :class:`BlockServer` serves a HostPool's blocks, :class:`BlockClient` pulls them into
another HostPool (straight into its slots, verified, under a :class:`LeaseTable` lease),
:class:`RemotePool` is the read side of a lower tier over a client; :mod:`tpusync.cluster.wire`
is the block frame.

Store nodes (`tpusync serve`): :class:`StoreNode` lends a process's DRAM to peers through a
:class:`StoreServer`; :class:`StoreNodePool` is that DRAM as a writable lower tier of a store.
"""

from tpusync.cluster.dataplane import (
    BlockClient,
    BlockServer,
    PeerUnavailableError,
    PullResult,
    RemoteOperationUnsupportedError,
    RemotePool,
)
from tpusync.cluster.leases import Lease, LeaseTable
from tpusync.cluster.registry import (
    Holder,
    MemoryRegistry,
    NodeInfo,
    Registry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync.cluster.registry_jax import JaxRegistry
from tpusync.cluster.registry_pool import RegistryPool
from tpusync.cluster.registry_redis import RedisRegistry
from tpusync.cluster.registry_server import (
    AuthenticationError,
    RegistryServer,
    RegistryUnavailableError,
    RemoteRegistry,
)
from tpusync.cluster.store_node import StoreNode, StoreNodePool, StoreServer
from tpusync.cluster.wire import FrameError

__all__ = [
    "AuthenticationError",
    "BlockClient",
    "BlockServer",
    "FrameError",
    "Holder",
    "JaxRegistry",
    "Lease",
    "LeaseTable",
    "MemoryRegistry",
    "NodeInfo",
    "PeerUnavailableError",
    "PullResult",
    "RedisRegistry",
    "Registry",
    "RegistryPool",
    "RegistryServer",
    "RegistryUnavailableError",
    "RemoteOperationUnsupportedError",
    "RemotePool",
    "RemoteRegistry",
    "StoreNode",
    "StoreNodePool",
    "StoreServer",
    "longest_common_prefix",
    "longest_prefix",
]
