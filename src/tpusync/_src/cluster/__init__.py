"""Across hosts: the registry of who holds which block, leases, the TCP data plane, store nodes,
and serving a KV store to peers.

Layers of this package (each imports only those before it): the shared connection machinery
(``supervisor``, ``circuit``: a :class:`PeerCircuits` per client, ``_admission``,
``_handshake``, ``tcp_server``, ``_rpc``; :func:`probe_health`
is what ``tpusync health`` runs); :mod:`tpusync._src.cluster.registry`
(the :class:`Registry` protocol and its backends: :class:`MemoryRegistry`, served by
:class:`RegistryServer` and reached through :class:`RemoteRegistry`; :class:`RedisRegistry`,
needs ``tpusync[cluster]``; :class:`JaxRegistry`, the coordination service of a
``jax.distributed`` job); :mod:`tpusync._src.cluster.dataplane` (:class:`BlockServer` serves a
HostPool's blocks, :class:`BlockClient` pulls them into another HostPool under a
:class:`LeaseTable` lease, :class:`RemotePool` is the read side of a lower tier over a client;
``dataplane.wire`` is the block frame); :class:`RegistryPool` (a lower tier over the registry
and the data plane); :mod:`tpusync._src.cluster.store_node` (`tpusync serve`: :class:`StoreNode`
lends a process's DRAM to peers through a :class:`StoreServer`; :class:`StoreNodePool` is that
DRAM as a writable lower tier of a store); :mod:`tpusync._src.cluster.serving` (a KV store served to
peers and listed in a registry). Its errors (``AuthenticationError``, ``PeerUnavailableError``,
``RegistryUnavailableError``, ...) are exported once, from :mod:`tpusync.errors`.
"""
