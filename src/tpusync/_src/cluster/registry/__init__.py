"""The registry: which live node holds which KV block, for cross-host prefix lookups.

One protocol (:mod:`~tpusync._src.cluster.registry.base`: :class:`Registry`, node records, the
longest prefix across nodes and shards), one liveness rule (``_leases``), several backends:
:class:`MemoryRegistry` (``memory``, embedded; served over TCP by :class:`RegistryServer`,
``server``, and reached through :class:`RemoteRegistry`, ``client``), :class:`RedisRegistry`
(``redis``) and :class:`JaxRegistry` (``jax``, the coordination service of a JAX job).
"""

# The checks were importable from the old tpusync._src.cluster.registry module: they stay here.
from tpusync._src.cluster.registry.base import MAX_KEY_BYTES as MAX_KEY_BYTES
from tpusync._src.cluster.registry.base import MAX_TIER_CHARS as MAX_TIER_CHARS
from tpusync._src.cluster.registry.base import (
    Holder,
    NodeInfo,
    PrefixRegistry,
    Registry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync._src.cluster.registry.base import check_exclude as check_exclude
from tpusync._src.cluster.registry.base import check_keys as check_keys
from tpusync._src.cluster.registry.base import check_node as check_node
from tpusync._src.cluster.registry.base import check_node_id as check_node_id
from tpusync._src.cluster.registry.base import check_tier as check_tier
from tpusync._src.cluster.registry.base import check_ttl as check_ttl
from tpusync._src.cluster.registry.base import node_from_dict as node_from_dict
from tpusync._src.cluster.registry.base import node_to_dict as node_to_dict
from tpusync._src.cluster.registry.base import prefix_of as prefix_of
from tpusync._src.cluster.registry.client import RemoteRegistry
from tpusync._src.cluster.registry.jax import JaxRegistry
from tpusync._src.cluster.registry.memory import MemoryRegistry
from tpusync._src.cluster.registry.redis import RedisRegistry
from tpusync._src.cluster.registry.server import RegistryServer

__all__ = [
    "Holder",
    "JaxRegistry",
    "MemoryRegistry",
    "NodeInfo",
    "PrefixRegistry",
    "RedisRegistry",
    "Registry",
    "RegistryServer",
    "RemoteRegistry",
    "longest_common_prefix",
    "longest_prefix",
]
