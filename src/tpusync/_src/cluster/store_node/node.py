"""A store node process's parts: :class:`StoreNode` (server, embedded registry, registry link)."""

from __future__ import annotations

import dataclasses
import logging
import os
import ssl
import threading
from collections.abc import Callable
from typing import Any

from tpusync._src.cluster.registry.base import NodeInfo, Registry, check_ttl
from tpusync._src.cluster.registry.memory import MemoryRegistry
from tpusync._src.cluster.registry.server import RegistryServer
from tpusync._src.cluster.registry_link import RegistryLink
from tpusync._src.cluster.store_node.server import StoreServer
from tpusync._src.cluster.tcp_server import (
    BlockServerOptions,
    ServerOptions,
)
from tpusync._src.tiers.dram import DEFAULT_SHM_DIR
from tpusync.errors import InvalidArgumentError

__all__ = ["StoreNode"]

log = logging.getLogger(__name__)


class StoreNode:
    """A store node process's parts: a :class:`StoreServer`, optionally an embedded registry
    served over TCP, and the link that publishes the node's blocks to a registry.

    Args:
      dram_bytes, max_layouts, name, shm_dir, secret, host, port, tls, insecure, disk_dir,
        disk_bytes: for the StoreServer.
      registry: a registry to publish to (a RemoteRegistry, RedisRegistry, ...), or None.
      registry_port: host an embedded registry on this port (0: a free one) of ``host``, and
        publish to it; :attr:`registry_address` is where peers reach it. Exclusive with
        ``registry``.
      node_id: this node's id in the registry (default: ``store-<host>:<port>``).
      ttl_s: the node's registry lease (renewed every third of it).
      lease_max_s: the longest a peer may hold a lease on the node's blocks, renewals
        included, and the longest a get may take to leave or a put to arrive (see
        :class:`~tpusync.cluster.BlockServerOptions`; None: 600 s).
    """

    def __init__(
        self,
        dram_bytes: int,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        max_layouts: int = 1,
        name: str | None = None,
        shm_dir: str = DEFAULT_SHM_DIR,
        registry: Registry | None = None,
        registry_port: int | None = None,
        node_id: str | None = None,
        ttl_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        disk_dir: str | os.PathLike[str] | None = None,
        disk_bytes: int = 0,
        lease_max_s: float | None = None,
    ) -> None:
        if registry is not None and registry_port is not None:
            raise InvalidArgumentError(
                "registry, registry_port: give a registry to publish to or host one, not both"
            )
        if registry is not None and not isinstance(registry, Registry):
            raise InvalidArgumentError(
                f"registry: expected a tpusync.cluster Registry, got {type(registry).__name__}"
            )
        ttl_s = check_ttl(ttl_s)
        self._failures_lock = threading.Lock()
        self._failure: tuple[str, BaseException] | None = None
        self._failure_callbacks: list[Callable[[str, BaseException], None]] = []
        self.registry_server: RegistryServer | None = None
        self.registry: Registry | None = registry
        self._link: Any = None
        listen = BlockServerOptions(
            secret=secret, host=host, port=port, tls=tls, insecure=insecure, lease_max_s=lease_max_s
        )
        self.server = StoreServer(
            dram_bytes,
            max_layouts=max_layouts,
            name=name,
            shm_dir=shm_dir,
            disk_dir=disk_dir,
            disk_bytes=disk_bytes,
            options=listen,
        )
        self.server.on_failure(self._failed)
        try:
            if registry_port is not None:
                embedded = MemoryRegistry()
                self.registry_server = RegistryServer(
                    embedded, options=_registry_options(listen, registry_port)
                )
                self.registry_server.on_failure(self._failed)
                self.registry = embedded
            if self.registry is not None:
                self.node = NodeInfo(
                    node_id or f"store-{self.server.address}", (self.server.address,)
                )
                self._link = RegistryLink(
                    self.registry,
                    self.node,
                    ttl_s,
                    self.server.keys,
                    on_failure=lambda exc: self._failed("the registry link's loop", exc),
                )
                self.server.on_added = self._link.added
                self.server.on_removed = self._link.removed
                self._link.added(self.server.keys())  # any put between the link's start and now
        except BaseException:
            self.close()
            raise

    @property
    def address(self) -> str:
        """Where peers reach the node's data plane."""
        return self.server.address

    @property
    def registry_address(self) -> str | None:
        """Where peers reach the embedded registry (None when not hosting one)."""
        return None if self.registry_server is None else self.registry_server.address

    @property
    def failure(self) -> tuple[str, BaseException] | None:
        """(which loop, its last exception) when a loop of the node's servers or its registry
        link kept dying and was given up on; None while all run."""
        return self._failure

    def on_failure(self, callback: Callable[[str, BaseException], None]) -> None:
        """Calls ``callback(loop, exc)`` once when a loop of the node (data server, embedded
        registry server, registry link) is given up on (at once if one has been); it runs on
        that loop's thread: signal, do not block. ``tpusync serve`` exits non-zero there."""
        with self._failures_lock:
            self._failure_callbacks.append(callback)
            failure = self._failure
        if failure is not None:
            callback(*failure)

    def _failed(self, loop: str, exc: BaseException) -> None:
        with self._failures_lock:
            if self._failure is not None:
                return
            self._failure = (loop, exc)
            callbacks = list(self._failure_callbacks)
        for callback in callbacks:
            try:
                callback(loop, exc)
            except Exception:  # one callback's fault must not keep the others from hearing
                log.exception("store node: a failure callback failed")

    def flush(self) -> None:
        """Sends the registry every change queued so far."""
        if self._link is not None:
            self._link.flush_changes()

    def close(self) -> None:
        """Unregisters the node, stops the servers and closes the pools."""
        if self._link is not None:
            self._link.close()
            self._link = None
        self.server.close()
        if self.registry_server is not None:
            self.registry_server.close()

    def __enter__(self) -> StoreNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _registry_options(listen: ServerOptions, port: int) -> ServerOptions:
    """The embedded registry server's options: the data plane's, on ``port``."""
    shared = {f.name: getattr(listen, f.name) for f in dataclasses.fields(ServerOptions)}
    return ServerOptions(**{**shared, "port": port})
