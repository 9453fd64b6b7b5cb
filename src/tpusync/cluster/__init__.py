"""Across hosts: the registry of who holds which block (and, to come, leases, the TCP data plane
and store nodes).

Registry backends: :class:`MemoryRegistry` (embedded; serve it to other processes with
:class:`RegistryServer`, reach it with :class:`RemoteRegistry`), :class:`RedisRegistry` (Redis or
Valkey; needs ``tpusync[cluster]``) and :class:`JaxRegistry` (the coordination service of a
``jax.distributed`` job).
"""

from tpusync.cluster.registry import (
    Holder,
    MemoryRegistry,
    NodeInfo,
    Registry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync.cluster.registry_jax import JaxRegistry
from tpusync.cluster.registry_redis import RedisRegistry
from tpusync.cluster.registry_server import (
    AuthenticationError,
    RegistryServer,
    RegistryUnavailableError,
    RemoteRegistry,
)

__all__ = [
    "AuthenticationError",
    "Holder",
    "JaxRegistry",
    "MemoryRegistry",
    "NodeInfo",
    "RedisRegistry",
    "Registry",
    "RegistryServer",
    "RegistryUnavailableError",
    "RemoteRegistry",
    "longest_common_prefix",
    "longest_prefix",
]
