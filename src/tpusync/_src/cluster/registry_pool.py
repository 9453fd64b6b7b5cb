"""RegistryPool: the blocks other live nodes hold, as one read-only lower tier of a KV store.

``contains`` asks the registry which live nodes hold each key; ``get`` pulls each key from one
holder (the first live one by node id, other than this node) over the data plane, straight into
the target DRAM slots, verified like every pull (:class:`~tpusync.cluster.BlockClient`). Clients
are opened per node on first use, at the node's registered addresses, and kept.

One slow or dead holder never holds up the others: each holder is asked on a thread of its own
(the last on the caller's), so the other holders' blocks land in their normal time while a
stalled one waits out its deadline; and each holder's address has a circuit
(:mod:`tpusync._src.cluster.circuit`): after a missed deadline or consecutive failures it is not
asked (its blocks are misses at once, or come from another live holder) until a probe after
its back-off finds it answering again. No lock is held while a client connects.

A store opens one for its spec ``KVStoreConfig(tiers=(RegistryTier(...),))``
(:class:`~tpusync.cluster.RegistryTier`): a decode process that knows only the registry's
address then finds and pulls a prefix that a prefill process saved and published
(:func:`tpusync._src.cluster.serving.publish_to`).
"""

from __future__ import annotations

import ssl
import sys
import threading
from collections.abc import Callable, Sequence

from tpusync._src.cluster.circuit import PeerCircuits
from tpusync._src.cluster.dataplane import BlockClient, RemotePool
from tpusync._src.cluster.registry.base import Registry, check_keys
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync._src.tiers.stats import TierStats
from tpusync.errors import (
    BlocksMissingError,
    CircuitOpenError,
    InvalidArgumentError,
    RemoteOperationUnsupportedError,
    TpuSyncError,
)

__all__ = ["RegistryPool"]


class RegistryPool:
    """A read-only tier over the cluster (see the module docstring).

    Args:
      registry: where holders are looked up.
      layout: the block layout (every node of one model shares it).
      secret: the data plane's shared secret.
      exclude: this node's id (its own blocks are found in its local tiers).
      connections: connections per peer (striping).
      timeout_s: each request's deadline (connecting included) and a pull's longest silence.
      tls, insecure: as for :class:`~tpusync.cluster.BlockClient` (TLS off loopback).
      same_host: as for :class:`~tpusync.cluster.BlockClient`: a peer on this host whose pool
        is a named /dev/shm pool is read from its file (False: always over TCP).
      circuits: the circuits of the peers' addresses (default: the pool's own, with the
        default rules of :class:`~tpusync.cluster.PeerCircuits`).
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
        circuits: PeerCircuits | None = None,
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
        if circuits is not None and not isinstance(circuits, PeerCircuits):
            raise InvalidArgumentError(
                f"circuits: expected a PeerCircuits or None, got {type(circuits).__name__}"
            )
        self.circuits = circuits if circuits is not None else PeerCircuits()
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
        self._addresses: dict[str, str] = {}  # node id -> its circuit's address
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
        """Each key's holder to ask: the first live one by node id (not this node) whose
        circuit lets requests through, else the first one (whose request then fails at once
        as a miss, or is the probe its circuit lets out)."""
        out: list[str | None] = []
        for held in self.registry.holders(keys):
            nodes = [h.node_id for h in held if h.node_id != self._exclude]
            usable = (n for n in nodes if self._address_usable(n))
            out.append(next(usable, nodes[0] if nodes else None))
        return out

    def _address_usable(self, node_id: str) -> bool:
        address = self._addresses.get(node_id)
        return address is None or self.circuits.available(address)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        return [node is not None for node in self._holder_per_key(keys)]

    def _peer(self, node_id: str) -> RemotePool | None:
        """The client of ``node_id``, connected on first use (outside the lock: a peer that
        does not answer holds up no request to the others); None when the node is gone.
        Raises CircuitOpenError without connecting while the node's circuit is open."""
        with self._lock:
            peer = self._peers.get(node_id)
        if peer is not None:
            return peer
        node = next((n for n in self.registry.nodes() if n.node_id == node_id), None)
        if node is None or not node.addresses:
            return None
        address = node.addresses[0]
        with self._lock:
            self._addresses[node_id] = address
        client = BlockClient(  # goes through the address's circuit (and connects at once)
            addresses=list(node.addresses),
            connections=self._connections,
            secret=self._secret,
            timeout_s=self._timeout,
            tls=self._tls,
            insecure=self._insecure,
            layout=self.layout,  # a store node serves the layout its client names
            same_host=self.same_host,
            circuits=self.circuits,
        )
        fresh = RemotePool(client, self.layout)
        with self._lock:
            peer = self._peers.setdefault(node_id, fresh)
        if peer is not fresh:  # another thread connected first
            fresh.close()
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

        def from_node(node: str, indices: list[int]) -> tuple[list[bool], int]:
            try:
                peer = self._peer(node)
                if peer is None:
                    return [False] * len(indices), 0
                return fetch(peer, indices)
            except CircuitOpenError:  # not asked: a miss at once (its client may stay)
                return [False] * len(indices), 0
            except TpuSyncError:  # that peer is gone or refused: its blocks are misses
                self._forget(node)
                return [False] * len(indices), 0

        # a thread per holder but the last (which runs here): no shared pool that one stalled
        # holder could fill, and no holder waits for another's deadline
        work = sorted(by_node.items())
        answers: dict[str, tuple[list[bool], int]] = {}
        errors: list[BaseException] = []

        def answer(node: str, indices: list[int]) -> None:
            try:
                answers[node] = from_node(node, indices)
            except BaseException as exc:  # raised on the caller's thread below
                errors.append(exc)

        threads = [
            threading.Thread(
                target=answer, args=(node, indices), name="tpusync-cluster-pull", daemon=True
            )
            for node, indices in work[:-1]
        ]
        for thread in threads:
            thread.start()
        try:
            if work:
                node, indices = work[-1]
                answers[node] = from_node(node, indices)
        finally:
            for thread in threads:
                thread.join()
        if errors:
            raise errors[0]
        for node, indices in work:
            ok, failed = answers.get(node, ([False] * len(indices), 0))
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
