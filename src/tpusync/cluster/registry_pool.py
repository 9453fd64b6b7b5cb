"""RegistryPool: the blocks other live nodes hold, as one read-only lower tier of a KV store.

``contains`` asks the registry which live nodes hold each key; ``get`` pulls each key from one
holder (the first live one by node id, other than this node) over the data plane, straight into
the target DRAM slots, verified like every pull (:class:`~tpusync.cluster.BlockClient`). Clients
are opened per node on first use, at the node's registered addresses, and kept.

Give it to a store as ``KVStoreConfig(extra_tiers=(("cluster", RegistryPool(...)),))``: a
decode process that knows only the registry's address then finds and pulls a prefix that a
prefill process saved and published (:meth:`tpusync.kv.KVCacheStore.publish_to`).
"""

from __future__ import annotations

import ssl
import sys
import threading
from collections.abc import Callable, Sequence

from tpusync.cluster.dataplane import BlockClient, RemotePool
from tpusync.cluster.registry.base import Registry, check_keys
from tpusync.errors import (
    BlocksMissingError,
    InvalidArgumentError,
    RemoteOperationUnsupportedError,
    TpuSyncError,
)
from tpusync.tiers.dram import HostPool
from tpusync.tiers.layout import PoolLayout
from tpusync.tiers.scatter import Scatter
from tpusync.tiers.stats import TierStats

__all__ = ["RegistryPool"]


class RegistryPool:
    """A read-only tier over the cluster (see the module docstring).

    Args:
      registry: where holders are looked up.
      layout: the block layout (every node of one model shares it).
      secret: the data plane's shared secret.
      exclude: this node's id (its own blocks are found in its local tiers).
      connections: connections per peer (striping).
      timeout_s: every socket operation's timeout.
      tls, insecure: as for :class:`~tpusync.cluster.BlockClient` (TLS off loopback).
      same_host: as for :class:`~tpusync.cluster.BlockClient`: a peer on this host whose pool
        is a named /dev/shm pool is read from its file (False: always over TCP).
    """

    read_only = True

    def __init__(
        self,
        registry: Registry,
        layout: PoolLayout,
        *,
        secret: bytes,
        exclude: str | None = None,
        connections: int = 1,
        timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        same_host: bool = True,
    ) -> None:
        if not isinstance(registry, Registry):
            raise InvalidArgumentError(
                f"registry: expected a Registry, got {type(registry).__name__}"
            )
        if not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout, got {type(layout).__name__}"
            )
        if not isinstance(same_host, bool):
            raise InvalidArgumentError(f"same_host: expected True or False, got {same_host!r}")
        self.registry = registry
        self.layout = layout
        self.same_host = same_host
        self.stats = TierStats("cluster")
        self._secret = secret
        self._exclude = exclude
        self._connections = connections
        self._timeout = timeout_s
        self._tls, self._insecure = tls, insecure
        self._peers: dict[str, RemotePool] = {}
        self._lock = threading.Lock()
        self._local_blocks_before = 0  # read from files by the clients of forgotten peers

    @property
    def local_blocks(self) -> int:
        """Blocks this pool read from peers' pool files on this host (``same_host``), verified,
        since it was made (the rest came over TCP)."""
        with self._lock:
            peers = list(self._peers.values())
            before = self._local_blocks_before
        return before + sum(peer.client.local_blocks for peer in peers)

    @property
    def capacity(self) -> int:
        return sys.maxsize

    @property
    def used(self) -> int:
        return 0  # not counted: the blocks are other nodes'

    def _holder_per_key(self, keys: list[bytes]) -> list[str | None]:
        return [
            next((h.node_id for h in held if h.node_id != self._exclude), None)
            for held in self.registry.holders(keys)
        ]

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        return [node is not None for node in self._holder_per_key(keys)]

    def _peer(self, node_id: str) -> RemotePool | None:
        with self._lock:
            peer = self._peers.get(node_id)
            if peer is not None:
                return peer
            node = next((n for n in self.registry.nodes() if n.node_id == node_id), None)
            if node is None or not node.addresses:
                return None
            client = BlockClient(
                addresses=list(node.addresses),
                connections=self._connections,
                secret=self._secret,
                timeout_s=self._timeout,
                tls=self._tls,
                insecure=self._insecure,
                layout=self.layout,  # a store node serves the layout its client names
                same_host=self.same_host,
            )
            peer = self._peers[node_id] = RemotePool(client, self.layout)
            return peer

    def _forget(self, node_id: str) -> None:
        """Closes the client of a peer that failed (the next pull from it connects anew)."""
        with self._lock:
            stale = self._peers.pop(node_id, None)
            if stale is not None:
                self._local_blocks_before += stale.client.local_blocks
        if stale is not None:
            stale.close()

    def _from_holders(
        self, keys: list[bytes], fetch: Callable[[RemotePool, list[int]], tuple[list[bool], int]]
    ) -> tuple[list[bool], int]:
        """Asks each key's live holder for it, one call per holder: ``fetch(peer, indices)``
        answers which of ``keys[indices]`` arrived and how many failed verification. A holder
        that is gone or refuses costs its blocks (its client is closed). Returns (arrived per
        key, failed verification)."""
        loaded = [False] * len(keys)
        corrupt = 0
        by_node: dict[str, list[int]] = {}
        for i, node in enumerate(self._holder_per_key(keys)):
            if node is not None:
                by_node.setdefault(node, []).append(i)
        for node, indices in sorted(by_node.items()):
            try:
                peer = self._peer(node)
                if peer is None:
                    continue
                ok, failed = fetch(peer, indices)
            except TpuSyncError:  # that peer is gone or refused: its blocks are misses
                self._forget(node)
                continue
            corrupt += failed
            for i, good in zip(indices, ok, strict=True):
                loaded[i] = bool(good)
        return loaded, corrupt

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Pulls each key from a live holder into ``target``; raises BlocksMissingError (with
        ``loaded``) for the keys no holder served, after committing the others."""
        keys = check_keys(keys)

        def fetch(peer: RemotePool, indices: list[int]) -> tuple[list[bool], int]:
            try:
                peer.get([keys[i] for i in indices], target)
            except BlocksMissingError as missing:
                return missing.loaded, missing.corrupt
            return [True] * len(indices), 0

        loaded, corrupt = self._from_holders(keys, fetch)
        hits = sum(loaded)
        self.stats.add(hits=hits, misses=len(keys) - hits, checksum_failures=corrupt)
        if hits < len(keys):
            raise BlocksMissingError(
                f"keys: {len(keys) - hits} of {len(keys)} blocks not served by the cluster",
                loaded=loaded,
                corrupt=corrupt,
            )

    def get_scattered(self, keys: Sequence[bytes], scatter: Scatter) -> list[bool]:
        """Receives each key from a live holder straight into the places ``scatter`` gives
        it (see :meth:`RemotePool.get_scattered`); returns which arrived verified."""
        keys = check_keys(keys)

        def fetch(peer: RemotePool, indices: list[int]) -> tuple[list[bool], int]:
            return peer.get_scattered_counted([keys[i] for i in indices], scatter.select(indices))

        loaded, corrupt = self._from_holders(keys, fetch)
        hits = sum(loaded)
        self.stats.add(hits=hits, misses=len(keys) - hits, checksum_failures=corrupt)
        return loaded

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        raise RemoteOperationUnsupportedError(
            "RegistryPool is read-only: nodes publish their own blocks (KVCacheStore.publish_to)"
        )

    def delete(self, keys: Sequence[bytes]) -> int:
        raise RemoteOperationUnsupportedError("RegistryPool is read-only")

    def keys(self) -> list[bytes]:
        raise RemoteOperationUnsupportedError("RegistryPool does not list the cluster's keys")

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
            self._local_blocks_before += sum(peer.client.local_blocks for peer in peers)
        for peer in peers:
            peer.close()

    def __enter__(self) -> RegistryPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
