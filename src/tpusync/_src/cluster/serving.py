"""Serving a KV store to peers: list its blocks in a registry (:func:`publish_to`) and serve them
over the data plane (:func:`serve`). The store takes the registry link as a
:class:`~tpusync._src.kv._peer_link.PeerLink` (kv imports no cluster)."""

from __future__ import annotations

import ssl

from tpusync._src.cluster.dataplane.server import BlockServer
from tpusync._src.cluster.registry.base import NodeInfo, Registry, check_ttl
from tpusync._src.cluster.registry_link import RegistryLink
from tpusync._src.kv.store import KVCacheStore
from tpusync.errors import InvalidArgumentError

__all__ = ["publish_to", "serve"]


def _check(store: KVCacheStore, registry: Registry) -> None:
    if not isinstance(store, KVCacheStore):
        raise InvalidArgumentError(f"store: expected a KVCacheStore, got {type(store).__name__}")
    store.check_peer_link_free()
    if not isinstance(registry, Registry):
        raise InvalidArgumentError(
            f"registry: expected a tpusync.cluster Registry, got {type(registry).__name__}"
        )


def publish_to(
    store: KVCacheStore, registry: Registry, node: NodeInfo, *, ttl_s: float = 10.0
) -> None:
    """Tells ``registry`` which blocks ``store``'s DRAM tier holds, as ``node`` (whose
    ``addresses`` are where a :class:`~tpusync.cluster.BlockServer` serves ``store.dram``):
    everything it holds now, then every block a save or promotion adds and every block DRAM
    drops, under a node lease renewed every ``ttl_s / 3``. ``store.close()`` unregisters the
    node."""
    _check(store, registry)
    if not isinstance(node, NodeInfo):
        raise InvalidArgumentError(f"node: expected a NodeInfo, got {type(node).__name__}")
    link = RegistryLink(registry, node, check_ttl(ttl_s), store.dram.keys)
    try:
        store.attach_peer_link(link)
    except BaseException:
        link.close()
        raise


def serve(
    store: KVCacheStore,
    registry: Registry,
    node_id: str,
    *,
    secret: bytes,
    host: str = "127.0.0.1",
    port: int = 0,
    group: str = "",
    ttl_s: float = 10.0,
    lease_ttl_s: float = 10.0,
    tls: ssl.SSLContext | None = None,
    insecure: bool = False,
) -> BlockServer:
    """Serves ``store``'s blocks to peers and lists them in ``registry``: a
    :class:`~tpusync.cluster.BlockServer` over ``store.dram`` that first moves what a peer asks
    for up from the local disk tier, and a node ``node_id`` (with the store's shard rank and
    count, in ``group``) publishing every block DRAM *or disk* holds -- so a restarted node
    lists at once what its /dev/shm and disk tiers still hold. Returns the server (its
    ``address`` is the node's); ``store.close()`` stops it and unregisters the node.
    ``secret``, ``tls``, ``insecure``, ``lease_ttl_s``: as for the BlockServer; ``ttl_s``: the
    node's registry lease."""
    _check(store, registry)
    ttl_s = check_ttl(ttl_s)
    server = BlockServer(
        store.dram,
        secret=secret,
        host=host,
        port=port,
        lease_ttl_s=lease_ttl_s,
        tls=tls,
        insecure=insecure,
        before_lease=store.promote_for_peers,
    )
    try:
        config = store.config
        node = NodeInfo(node_id, (server.address,), group, config.shard_rank, config.shard_count)
        link = RegistryLink(registry, node, ttl_s, lambda: store.peer_keys(include_disk=True))
    except BaseException:
        server.close()
        raise
    try:
        store.attach_peer_link(link, server=server, include_disk=True)
    except BaseException:
        link.close()
        server.close()
        raise
    return server
