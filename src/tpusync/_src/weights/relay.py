"""Fan-out: :class:`Relay` nodes keep the newest versions of a weights stream and serve their
chunks, so that the trainer's link carries one copy per relay and version, not one per
sampler (docs/decisions/0015-weights-fan-out.md says why this shape).

A relay follows the publisher's head; for each new version it reads the manifest from the
publisher (the one source it trusts for it), takes every chunk of the version's own stream
from ``upstream`` (another relay, forming a tree; by default the publisher), checks each
against the SHA-256 the publisher put in the manifest (``Publisher(relays=True)``), fetches
the ones that fail from the publisher, and then lists the version in the registry. A
subscriber made with ``relays=True`` takes chunks from the relays listing the version and
checks them the same way: a relay that dies or serves damaged or forged bytes (even one that
knows the secret) costs a retry from another source, never a wrong byte.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync._src.cluster.dataplane import BlockClient, BlockServer
from tpusync._src.cluster.dataplane.deadlines import MAX_LIMIT_S
from tpusync._src.cluster.registry import NodeInfo, Registry
from tpusync._src.cluster.registry_link import RegistryLink
from tpusync._src.engines import native
from tpusync._src.tiers.dram import HostPool
from tpusync._src.weights.manifest import Manifest, check_name, chunk_key, chunk_layout, relay_key
from tpusync._src.weights.options import (
    TlsOptions,
    WeightsClientOptions,
    WeightsPoolOptions,
    WeightsServerOptions,
    block_server_options,
    check_registry,
    options_or_default,
)
from tpusync._src.weights.relayed import Waits, relay_addresses, take_all
from tpusync._src.weights.subscriber import Subscriber
from tpusync.errors import (
    InvalidArgumentError,
    PeerUnavailableError,
    TpuSyncError,
    WeightSyncError,
)

__all__ = ["Relay", "RelayReport"]

log = logging.getLogger("tpusync.weights")

_BATCH = 16  # chunks a request


@dataclass(frozen=True)
class RelayReport:
    """One version a relay copied: the chunks it took from its upstream relay and from the
    publisher, and the seconds from its manifest to its last chunk."""

    version: int
    chunks_upstream: int
    chunks_publisher: int
    seconds: float


class Relay:
    """Serves the newest versions of the weights ``name`` to subscribers (``relays=True``).

    Args:
      name: the publisher's weights name (its ``Publisher`` needs ``relays=True``).
      secret: the deployment secret.
      registry: where the publisher is found and this relay lists the versions it holds.
      upstream: ``"host:port"`` of another relay to take chunks from (a tree of relays);
        None (the default): the publisher. Chunks the upstream lacks or fails come from the
        publisher.
      pool: ``keep`` (versions held, default 2) and ``capacity_bytes`` (default: ``keep + 1``
        versions of the first one) of this relay's memory.
      server: where it serves (host, port) and its registry lease (``registry_ttl_s``).
      client: its connections to the publisher and upstream, and the deadline of each
        version's copy (``deadline_s``).
      tls: the data plane's TLS, both ways (a context that serves and one that trusts).
    """

    def __init__(
        self,
        name: str,
        *,
        secret: bytes,
        registry: Registry,
        upstream: str | None = None,
        pool: WeightsPoolOptions | None = None,
        server: WeightsServerOptions | None = None,
        client: WeightsClientOptions | None = None,
        tls: TlsOptions | None = None,
    ) -> None:
        self.name = check_name(name)
        if registry is None:
            raise InvalidArgumentError("registry: a relay lists its versions in a registry")
        check_registry(registry)
        if upstream is not None and (not isinstance(upstream, str) or ":" not in upstream):
            raise InvalidArgumentError(f"upstream: expected 'host:port' or None, got {upstream!r}")
        self.upstream = upstream
        self.pool_options = options_or_default(WeightsPoolOptions, pool, "pool")
        self.server_options = options_or_default(WeightsServerOptions, server, "server")
        self.client_options = options_or_default(WeightsClientOptions, client, "client")
        self.tls = options_or_default(TlsOptions, tls, "tls")
        self._secret, self._registry = secret, registry
        self._server_options = block_server_options(secret, self.server_options, self.tls)
        # the publisher's head and manifests, read as a subscriber of no leaves reads them
        self._probe = Subscriber(
            name, {}, secret=secret, registry=registry, client=self.client_options, tls=tls
        )
        self._lock = threading.Lock()
        self._held: dict[int, list[bytes]] = {}  # version -> its chunk keys, oldest first
        self.pool: HostPool | None = None
        self.server: BlockServer | None = None
        self._link: RegistryLink | None = None
        self._upstream_client: BlockClient | None = None
        self._upstream_seen = False  # the upstream relay was in the registry once
        self._hashers = ThreadPoolExecutor(
            max_workers=native.copy_threads(), thread_name_prefix="tpusync-relay-digest"
        )
        self._stop = threading.Event()
        self.failures = 0  # versions that could not be relayed (logged)
        self.last: RelayReport | None = None  # the last version copied whole
        self._thread = threading.Thread(
            target=self._follow, name=f"tpusync-relay-{name}", daemon=True
        )
        self._thread.start()

    @property
    def versions(self) -> list[int]:
        """The versions this relay lists (the newest may still be filling), oldest first."""
        with self._lock:
            return sorted(self._held)

    @property
    def address(self) -> str | None:
        """Where it serves (None until it holds its first version)."""
        return None if self.server is None else self.server.address

    def wait_for(self, version: int, timeout_s: float) -> bool:
        """Whether this relay holds every chunk of ``version`` (or lists a later one) within
        ``timeout_s``."""
        return self._wait(lambda: self._whole(version), timeout_s)

    def _whole(self, version: int) -> bool:
        with self._lock:
            if any(v > version for v in self._held):
                return True
            keys = self._held.get(version)
        return keys is not None and self.pool is not None and all(self.pool.contains(keys))

    def _wait(self, condition: Any, timeout_s: float) -> bool:
        """Whether ``condition()`` holds within ``timeout_s`` (asked every ``poll_s``)."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            self._stop.wait(self.client_options.poll_s)
        return True

    # --- following the publisher --------------------------------------------------------------

    def _follow(self) -> None:
        last = -1
        while not self._stop.is_set():
            try:
                head = self._probe._wait_for_head(last, 1.0)
            except TpuSyncError as error:  # the publisher restarting: asked again
                log.debug("tpusync relay %s: head: %s", self.name, error)
                self._stop.wait(self.client_options.poll_s)
                continue
            if head is None or head.latest is None:
                continue
            version = head.latest
            try:
                self._relay(version)
            except (TpuSyncError, OSError) as error:
                self.failures += 1
                log.warning(
                    "tpusync relay %s: version %d not relayed (%s); subscribers take it from "
                    "the publisher",
                    self.name,
                    version,
                    error,
                )
            last = version

    def _relay(self, version: int) -> None:
        """Copies ``version``, listed from its start: a subscriber or relay below takes each
        chunk as it lands here (a chain passes chunks on as they arrive)."""
        probe = self._probe
        limit = self.client_options.deadline_s
        with probe._manifest_of(version, limit, "relaying it") as (publisher, _, manifest):
            digests = manifest.digests
            if digests is None:
                raise InvalidArgumentError(
                    f"version {version} carries no chunk digests: publish with "
                    "Publisher(relays=True) for relays to serve it"
                )
            self._open(manifest)
            self._drop_beyond(self.pool_options.keep - 1)
            assert self.pool is not None and self._link is not None
            keys = [chunk_key(self.name, version, i) for i in range(manifest.n_chunks)]
            with self._lock:
                self._held[version] = keys
            self._link.added([relay_key(self.name, version)])
            with contextlib.suppress(TpuSyncError, OSError):  # else listed at the next heartbeat
                self._link.flush_changes()
            start = time.perf_counter()
            from_upstream = 0
            try:
                todo = np.arange(manifest.n_chunks)
                waits = Waits(
                    self.client_options.poll_s,
                    self.client_options.relay_wait_s,
                    time.monotonic() + limit,
                    self._stop,
                )
                for source in (self._upstream(version), publisher):
                    if source is None or not len(todo):
                        continue
                    upstream = source is not publisher
                    taken = take_all(
                        source, [keys[i] for i in todo.tolist()], todo, digests, self.pool,
                        self._hashers, waits, self._landed,
                    )  # fmt: skip
                    todo = todo[~taken]
                    from_upstream += int(taken.sum()) if upstream else 0
                    if len(todo) and upstream:
                        self._close_upstream()  # stalled or failed: connected afresh next time
                if len(todo):
                    raise WeightSyncError(
                        f"chunks {todo.tolist()[:8]} of version {version} could not be taken "
                        "checked, from the publisher either"
                    )
            except BaseException:
                self._drop(version)
                raise
            self.last = RelayReport(
                version, from_upstream, manifest.n_chunks - from_upstream,
                time.perf_counter() - start,
            )  # fmt: skip

    def _landed(self, keys: list[bytes], numbers: np.ndarray) -> None:
        """Called with the chunks of each batch once they landed checked (served from now)."""

    def _upstream(self, version: int) -> BlockClient | None:
        """The upstream relay's client once it lists ``version``; None when there is no
        upstream, when it did not list the version within the client options'
        ``relay_wait_s``, or when it stopped (it refuses connections, or left the registry
        after it had been in it)."""
        if self.upstream is None:
            return None
        gone = threading.Event()

        def listed() -> bool:
            try:
                nodes = self._registry.nodes()
            except TpuSyncError:
                return False
            if not any(self.upstream in n.addresses for n in nodes):
                if self._upstream_seen:
                    gone.set()
                return gone.is_set()
            self._upstream_seen = True
            if self._connect_upstream() is None:  # listed still, but stopped
                gone.set()
                return True
            return self.upstream in relay_addresses(self._registry, self.name, version)

        if not self._wait(listed, self.client_options.relay_wait_s) or gone.is_set():
            return None
        return self._upstream_client

    def _connect_upstream(self) -> BlockClient | None:
        """The upstream relay's client (connected now if need be); None if it cannot be."""
        if self._upstream_client is None:
            assert self.upstream is not None
            try:
                self._upstream_client = BlockClient(
                    self.upstream,
                    secret=self._secret,
                    connections=self.client_options.connections,
                    timeout_s=self.client_options.timeout_s,
                    tls=self.tls.context,
                    insecure=self.tls.insecure,
                    same_host=False,
                    max_pull_s=MAX_LIMIT_S,
                )
            except PeerUnavailableError as error:
                log.warning("tpusync relay %s: upstream %s: %s", self.name, self.upstream, error)
                return None
        return self._upstream_client

    def _close_upstream(self) -> None:
        client, self._upstream_client = self._upstream_client, None
        if client is not None:
            client.close()

    def _open(self, manifest: Manifest) -> None:
        """The pool (sized for ``keep + 1`` versions of ``manifest``'s), its server and its
        registry link, made at the first version."""
        if self._stop.is_set():  # close() joins this thread before it closes what _open made
            raise WeightSyncError("this Relay is closed")
        if self.pool is not None:
            if self.pool.layout.payload_bytes != manifest.chunk_bytes:
                raise InvalidArgumentError(
                    f"version {manifest.version} has chunks of {manifest.chunk_bytes} bytes, "
                    f"this relay's pool {self.pool.layout.payload_bytes}: restart the relay"
                )
            return
        capacity = self.pool_options.capacity_bytes
        slots = (
            (self.pool_options.keep + 1) * manifest.n_chunks
            if capacity is None
            else capacity // manifest.chunk_bytes
        )
        pool = HostPool(chunk_layout(self.name, manifest.chunk_bytes), max(slots, 1))
        try:
            server = BlockServer(pool, options=self._server_options)
        except BaseException:
            pool.close()
            raise
        node_id = (
            "weights-relay-"
            + hashlib.blake2b(f"{self.name}\0{server.address}".encode(), digest_size=8).hexdigest()
        )
        self.pool, self.server = pool, server
        self._link = RegistryLink(
            self._registry,
            NodeInfo(node_id, (server.address,), group="weights-relay"),
            self.server_options.registry_ttl_s,
            self._listed_keys,
        )

    def _listed_keys(self) -> list[bytes]:
        with self._lock:
            return [relay_key(self.name, v) for v in self._held]

    def _drop_beyond(self, keep: int) -> None:
        """Drops the oldest versions until ``keep`` are held."""
        with self._lock:
            old = sorted(self._held)[: max(0, len(self._held) - keep)]
        for version in old:
            self._drop(version)

    def _drop(self, version: int) -> None:
        """Withdraws ``version`` from the registry, then frees its chunks."""
        with self._lock:
            keys = self._held.pop(version, None)
        if keys is None:
            return
        assert self._link is not None and self.pool is not None
        self._link.removed([relay_key(self.name, version)])
        with contextlib.suppress(TpuSyncError, OSError):
            self._link.flush_changes()
        self.pool.delete(keys)

    # --- closing ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops following, withdraws its versions from the registry and stops serving."""
        self._stop.set()
        self._probe.close()  # ends a wait or a copy from the publisher in progress
        client = self._upstream_client
        if client is not None:
            client.close()  # and one from the upstream relay
        self._thread.join()
        self._close_upstream()
        if self._link is not None:
            self._link.close()
        if self.server is not None:
            self.server.close()
        if self.pool is not None:
            self.pool.close()
        self._hashers.shutdown(wait=True)

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
