"""Tier specs of the tiers over other hosts, for ``KVStoreConfig(tiers=(...))``: the store
opens them itself with its own block layout (no :class:`~tpusync.tiers.PoolLayout` to build)
and closes them when it closes.

* :class:`StoreNodeTier`: a store node's DRAM (``tpusync serve``), written through, demoted to
  and read (a :class:`~tpusync.cluster.StoreNodePool`).
* :class:`RegistryTier`: the blocks other nodes publish to a registry, read only; hits are
  pulled from their holders (a :class:`~tpusync.cluster.RegistryPool`).
* :class:`PeerTier`: one peer's served DRAM (a :class:`~tpusync.cluster.BlockServer`, e.g. a
  store's ``serve``), read only (a :class:`~tpusync.cluster.RemotePool`).

They use the store's ``KVStoreConfig.secret`` as the data plane's secret unless given their own
``secret``. In the plain-data form of a config (:mod:`tpusync._src.kv.config_dict`) a store node is
the section ``"store_node"``, a peer ``"peer"`` and a registry tier ``"registry"`` (by its
``address`` or ``redis_url``: a registry object has no plain form).
"""

from __future__ import annotations

import logging
import numbers
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpusync._src.cluster.dataplane import BlockClient, RemotePool
from tpusync._src.cluster.reconnecting_tier import ReconnectingTier
from tpusync._src.cluster.registry import RedisRegistry, Registry, RemoteRegistry
from tpusync._src.cluster.registry_pool import RegistryPool
from tpusync._src.cluster.store_node import StoreNodePool
from tpusync._src.kv.config_dict import register_tier_section
from tpusync._src.kv.secret import check_secret
from tpusync._src.kv.tier_specs import check_tier_name
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.spec import OpenedTier, TierContext
from tpusync.errors import InvalidArgumentError, PeerUnavailableError

log = logging.getLogger(__name__)

__all__ = ["PeerTier", "RegistryTier", "StoreNodeTier"]


def _check_client_fields(
    name: str, connections: Any, timeout_s: Any, tls: Any, insecure: Any, secret: Any
) -> None:
    if connections is not None and (
        not isinstance(connections, numbers.Integral)
        or isinstance(connections, bool)
        or connections < 1
    ):
        raise InvalidArgumentError(
            f"{name}.connections: expected None or a positive int, got {connections!r}"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or timeout_s <= 0:
        raise InvalidArgumentError(
            f"{name}.timeout_s: expected a positive number of seconds, got {timeout_s!r}"
        )
    if tls is not None and not isinstance(tls, ssl.SSLContext):
        raise InvalidArgumentError(
            f"{name}.tls: expected None or an ssl.SSLContext, got {type(tls).__name__}"
        )
    if insecure is not True and insecure is not False:
        raise InvalidArgumentError(f"{name}.insecure: expected True or False, got {insecure!r}")
    if secret is not None:  # the handshake's floor, checked where the config is made
        check_secret(secret, f"{name}.secret (None: the store's secret)")


def _check_addresses(name: str, address: Any, addresses: Any) -> tuple[str, ...] | None:
    """Refuses anything but one of ``address`` ('host:port') or ``addresses``; returns the
    addresses as a tuple."""
    if (address is None) == (addresses is None):
        raise InvalidArgumentError(
            f"{name}.address: give the peer's address or addresses (one of the two)"
        )
    if address is not None and not isinstance(address, str):
        raise InvalidArgumentError(f"{name}.address: expected 'host:port', got {address!r}")
    if addresses is None:
        return None
    if not isinstance(addresses, Sequence) or isinstance(addresses, str):
        raise InvalidArgumentError(
            f"{name}.addresses: expected a sequence of 'host:port', got {addresses!r}"
        )
    return tuple(addresses)


@dataclass(frozen=True)
class _PeerSpec:
    """The fields and checks a tier over one peer's data plane shares: where it is, how it is
    reached (as for :class:`~tpusync.cluster.BlockClient`) and the tier's name."""

    address: str | None = None
    addresses: tuple[str, ...] | None = None
    connections: int | None = None
    timeout_s: float = 10.0
    tls: ssl.SSLContext | None = None
    insecure: bool = False
    secret: bytes | None = field(default=None, repr=False)
    name: str = ""
    same_host: bool = True

    section = ""  # the spec's section in the plain-data form of a config

    def __post_init__(self) -> None:
        check_tier_name(self.name, f"{self.section}.name")
        addresses = _check_addresses(self.name, self.address, self.addresses)
        object.__setattr__(self, "addresses", addresses)
        _check_client_fields(
            self.name, self.connections, self.timeout_s, self.tls, self.insecure, self.secret
        )
        if self.same_host is not True and self.same_host is not False:
            raise InvalidArgumentError(
                f"{self.name}.same_host: expected True or False, got {self.same_host!r}"
            )

    def check(self, context: TierContext) -> None:
        pass  # the peer is reached when the tier opens

    def _client_options(self, context: TierContext) -> dict[str, Any]:
        return {
            "addresses": None if self.addresses is None else list(self.addresses),
            "connections": self.connections,
            "secret": self.secret or context.secret,
            "timeout_s": self.timeout_s,
            "tls": self.tls,
            "insecure": self.insecure,
            "same_host": self.same_host,
        }


@dataclass(frozen=True)
class StoreNodeTier(_PeerSpec):
    """A store node (``tpusync serve``) as a writable lower tier.

    Args:
      address: the node's ``host:port`` (or ``addresses``: several, striped).
      connections, timeout_s, tls, insecure, same_host: as for
        :class:`~tpusync.cluster.BlockClient` (``same_host``: a node on this host whose DRAM
        is a named /dev/shm pool, ``tpusync serve --name``, is read from its pool file).
      secret: the data plane's secret; None: the store's ``KVStoreConfig.secret``.
      name: the tier's name in the store.
    """

    name: str = "node"

    section = "store_node"

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        options = self._client_options(context)
        return _open_or_reconnect(
            lambda: StoreNodePool(self.address, layout=layout, **options),
            layout,
            f"{self.name} (store node {self.address or ','.join(self.addresses or ())})",
            read_only=False,
        )


@dataclass(frozen=True)
class RegistryTier:
    """The blocks other nodes publish to a registry, as a read-only lower tier.

    Args:
      registry: where holders are looked up (any :class:`~tpusync.cluster.Registry`; the store
        does not close it). Or, instead, one the tier opens and closes itself:
      address: a :class:`~tpusync.cluster.RegistryServer`'s ``host:port`` (reached with
        :class:`~tpusync.cluster.RemoteRegistry`, the data plane's secret and ``tls``), or
      redis_url, redis_prefix: a :class:`~tpusync.cluster.RedisRegistry`.
      exclude: this node's id (its own blocks are in its local tiers).
      connections, timeout_s, tls, insecure, same_host: as for
        :class:`~tpusync.cluster.BlockClient` (``same_host``: peers on this host whose DRAM is
        a named /dev/shm pool are read from its file).
      secret: the data plane's secret; None: the store's ``KVStoreConfig.secret``.
      name: the tier's name in the store.
    """

    registry: Registry | None = None
    exclude: str | None = None
    address: str | None = None
    redis_url: str | None = None
    redis_prefix: str = "tpusync"
    connections: int = 1
    timeout_s: float = 10.0
    tls: ssl.SSLContext | None = None
    insecure: bool = False
    secret: bytes | None = field(default=None, repr=False)
    name: str = "cluster"
    same_host: bool = True

    def __post_init__(self) -> None:
        check_tier_name(self.name, "registry.name")
        if self.same_host is not True and self.same_host is not False:
            raise InvalidArgumentError(
                f"{self.name}.same_host: expected True or False, got {self.same_host!r}"
            )
        given = [self.registry is not None, self.address is not None, self.redis_url is not None]
        if sum(given) != 1:
            raise InvalidArgumentError(
                f"{self.name}.registry: give one of registry (a Registry), address (a "
                "RegistryServer's host:port) or redis_url"
            )
        if self.registry is not None and not isinstance(self.registry, Registry):
            raise InvalidArgumentError(
                f"{self.name}.registry: expected a tpusync.cluster.Registry, got "
                f"{type(self.registry).__name__}"
            )
        for key in ("address", "redis_url", "redis_prefix"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(
                    f"{self.name}.{key}: expected a non-empty string, got {value!r}"
                )
        if self.exclude is not None and not isinstance(self.exclude, str):
            raise InvalidArgumentError(
                f"{self.name}.exclude: expected None or a node id, got {self.exclude!r}"
            )
        _check_client_fields(
            self.name, self.connections, self.timeout_s, self.tls, self.insecure, self.secret
        )

    def check(self, context: TierContext) -> None:
        pass

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        where = self.address or self.redis_url or "a registry"
        return _open_or_reconnect(
            lambda: self._open(layout, context), layout, f"{self.name} ({where})", read_only=True
        )

    def _open(self, layout: PoolLayout, context: TierContext) -> _RegistryPool:
        secret = self.secret or context.secret
        owned: Registry | None = None
        if self.address is not None:
            owned = RemoteRegistry(
                self.address,
                secret=secret,
                timeout_s=self.timeout_s,
                tls=self.tls,
                insecure=self.insecure,
            )
        elif self.redis_url is not None:
            owned = RedisRegistry(
                self.redis_url, prefix=self.redis_prefix, timeout_s=self.timeout_s
            )
        registry = owned if owned is not None else self.registry
        assert registry is not None
        try:
            pool = _RegistryPool(
                registry,
                layout,
                secret=secret,
                exclude=self.exclude,
                connections=self.connections,
                timeout_s=self.timeout_s,
                tls=self.tls,
                insecure=self.insecure,
                same_host=self.same_host,
            )
        except BaseException:
            if owned is not None:
                owned.close()
            raise
        pool.owned_registry = owned
        return pool


class _RegistryPool(RegistryPool):
    """A RegistryPool that also closes the registry its spec opened for it."""

    owned_registry: Registry | None = None

    def close(self) -> None:
        super().close()
        if self.owned_registry is not None:
            self.owned_registry.close()
            self.owned_registry = None


@dataclass(frozen=True)
class PeerTier(_PeerSpec):
    """One peer's served DRAM (its :class:`~tpusync.cluster.BlockServer`) as a read-only lower
    tier: hits are pulled into this store's DRAM.

    Args:
      address: the peer's ``host:port`` (or ``addresses``: several, striped).
      connections, timeout_s, tls, insecure, same_host: as for
        :class:`~tpusync.cluster.BlockClient`.
      secret: the data plane's secret; None: the store's ``KVStoreConfig.secret``.
      name: the tier's name in the store.
    """

    name: str = "remote"

    section = "peer"

    def open(self, layout: PoolLayout, context: TierContext) -> OpenedTier:
        options = self._client_options(context)

        def remote_pool() -> RemotePool:
            client = BlockClient(self.address, layout=layout, **options)
            try:
                return RemotePool(client, layout)
            except BaseException:
                client.close()
                raise

        label = f"{self.name} (peer {self.address or ','.join(self.addresses or ())})"
        return _open_or_reconnect(remote_pool, layout, label, read_only=True)


def _open_or_reconnect(
    open_tier: Callable[[], Any], layout: PoolLayout, label: str, *, read_only: bool
) -> OpenedTier:
    """The tier ``open_tier()`` opens, or, while its peer cannot be reached, a
    :class:`ReconnectingTier` that keeps trying in the background (a miss until then): a store
    starts degraded rather than not at all."""
    try:
        return OpenedTier(open_tier(), read_only=read_only)
    except PeerUnavailableError as error:
        log.warning(
            "tpusync: %s cannot be reached (%s); the store opens without it and keeps trying",
            label,
            error,
        )
    tier = ReconnectingTier(open_tier, layout=layout, label=label, read_only=read_only)
    return OpenedTier(tier, read_only=read_only)


register_tier_section("store_node", StoreNodeTier)
register_tier_section("peer", PeerTier)
register_tier_section("registry", RegistryTier)  # its address or redis_url: not a Registry
