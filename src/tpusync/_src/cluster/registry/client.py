"""The registry's client: :class:`RemoteRegistry`, a :class:`~tpusync.cluster.Registry` served
by a :class:`~tpusync.cluster.RegistryServer` (its wire format:
:mod:`tpusync._src.cluster.registry.server`)."""

from __future__ import annotations

import ssl
import threading
from collections.abc import Sequence
from typing import Any

from tpusync._src.cluster._handshake import _check_secret, check_transport, parse_address
from tpusync._src.cluster._rpc import RpcConnection
from tpusync._src.cluster.registry._wire import _holders_from_wire, _keys_to_wire
from tpusync._src.cluster.registry.base import (
    Holder,
    NodeInfo,
    batched,
    check_answer,
    check_exclude,
    check_keys,
    check_node,
    check_node_id,
    check_tier,
    check_ttl,
    node_from_dict,
    node_to_dict,
    prefix_of,
)
from tpusync.errors import InvalidArgumentError, RegistryUnavailableError

__all__ = ["RemoteRegistry"]

BATCH_KEYS = 4096  # keys per request: far below MAX_FRAME even for 32-byte keys


class _UnknownMethodError(RegistryUnavailableError):
    """The server does not know the method (it predates it)."""


class _ConnectionLost(RegistryUnavailableError):
    """The server closed the connection: worth one reconnect."""


class RemoteRegistry:
    """A :class:`Registry` served by a :class:`RegistryServer` at ``address`` (``"host:port"``).

    Connects (and authenticates both ways) at once; one connection, used under a lock. A broken
    connection is re-made once per call; each call has one deadline, ``timeout_s`` from its
    start (connecting and the reconnection included).

    Raises:
      AuthenticationError: the server and this client do not share ``secret``.
      RegistryUnavailableError: the server cannot be reached, or stopped answering.
    """

    def __init__(
        self,
        address: str,
        *,
        secret: bytes,
        timeout_s: float = 10.0,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
    ) -> None:
        host, port = parse_address(address)
        check_transport(host, tls, insecure, "address")
        _check_secret(secret)
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise InvalidArgumentError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        self._address = address
        self._timeout = float(timeout_s)
        self._lock = threading.Lock()
        self._conn = RpcConnection(
            (host, port),
            peer=f"the registry server at {address}",
            secret=secret,
            timeout=self._timeout,
            tls=tls,
            unavailable=RegistryUnavailableError,
            lost=_ConnectionLost,
            unknown_method=_UnknownMethodError,
        )
        self._closed = False
        self._no_prefix = False  # the server predates the "prefix" method
        with self._lock:
            self._conn.connect()

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        with self._lock:
            if self._closed:
                raise RegistryUnavailableError("this RemoteRegistry was closed")
            return self._conn.call(method, params)

    def ping(self) -> None:
        self._call("ping", {})

    def register(self, node: NodeInfo, ttl_s: float) -> None:
        check_node(node)
        self._call("register", {"node": node_to_dict(node), "ttl_s": check_ttl(ttl_s)})

    def heartbeat(self, node_id: str, ttl_s: float) -> bool:
        ttl = check_ttl(ttl_s)
        return bool(self._call("heartbeat", {"node_id": check_node_id(node_id), "ttl_s": ttl}))

    def unregister(self, node_id: str) -> None:
        self._call("unregister", {"node_id": check_node_id(node_id)})

    def publish(self, node_id: str, keys: Sequence[bytes], tier: str) -> None:
        keys = check_keys(keys)
        check_tier(tier)
        check_node_id(node_id)
        for batch in batched(keys, BATCH_KEYS, at_least_one=True):
            params = {"node_id": node_id, "keys": [k.hex() for k in batch], "tier": tier}
            self._call("publish", params)

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        check_node_id(node_id)
        for batch in batched(keys, BATCH_KEYS):
            self._call("withdraw", {"node_id": node_id, "keys": [k.hex() for k in batch]})

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        out: list[list[Holder]] = []
        for batch in batched(keys, BATCH_KEYS):
            result = self._call("holders", {"keys": [k.hex() for k in batch], "compact": True})
            out.extend(
                check_answer(_holders_from_wire(result, "holders"), len(batch), result, "holders")
            )
        return out

    def prefix_holders(
        self, keys: Sequence[bytes], *, exclude: str | None = None
    ) -> list[list[Holder]]:
        """See :meth:`~tpusync._src.cluster.registry.PrefixRegistry.prefix_holders`: one request
        (per 4096 keys) that the server answers for the leading keys only."""
        keys = check_keys(keys)
        check_exclude(exclude)
        out: list[list[Holder]] = []
        for batch in batched(keys, BATCH_KEYS):  # every batch before this one was wholly held
            if self._no_prefix:
                return out + prefix_of(self.holders(keys[len(out) :]), exclude)[1]
            params = {"keys": _keys_to_wire(batch), "exclude": exclude}
            try:
                result = self._call("prefix", params)
            except _UnknownMethodError:
                self._no_prefix = True
                return out + prefix_of(self.holders(keys[len(out) :]), exclude)[1]
            found = _holders_from_wire(result, "prefix")
            if len(found) > len(batch) or not all(found):
                raise RegistryUnavailableError(f"malformed prefix answer: {result!r:.200}")
            out.extend(found)
            if len(found) < len(batch):
                break
        return out

    def nodes(self) -> list[NodeInfo]:
        result = self._call("nodes", {})
        return [node_from_dict(d) for d in result]

    def sweep(self) -> int:
        """Runs the served registry's sweep (where it has one); returns the nodes removed."""
        return int(self._call("sweep", {}))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._conn.drop()

    def __enter__(self) -> RemoteRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
