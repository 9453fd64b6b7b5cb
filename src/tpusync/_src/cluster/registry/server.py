"""Serving a registry over TCP: :class:`RegistryServer` (any :class:`Registry`, typically the
embedded :class:`MemoryRegistry`) and :class:`RemoteRegistry`, a client that is itself a
:class:`Registry`.

Wire format (version 1): every message is a frame — a 4-byte big-endian length, then that many
bytes of UTF-8 JSON (at most 16 MiB; a larger length closes the connection). Keys travel as hex
strings. One request, one response, matched by a request id::

    request:  {"id": 7, "method": "holders", "params": {"keys": ["0a1b..", ...]}}
    response: {"id": 7, "result": [[["node-a", "dram"]], []]}
    error:    {"id": 7, "error": {"type": "InvalidArgumentError", "message": "..."}}

Lookups may ask for a compact answer: each distinct (node, tier) once (``holders``), each
distinct holder list once as indices into that (``rows``), and the keys' holder lists as runs of
[row, how many keys] (``runs``; a 512-key prefix that one node holds is ``[[0, 512]]``).
``holders`` answers so when its params say ``"compact": true`` (a server that predates it
ignores that and answers as above); ``prefix`` (the fast prefix lookup,
:meth:`RemoteRegistry.prefix_holders`) always does, for the leading keys some live node other
than ``exclude`` holds (a server that predates it answers "unknown method", and the client falls
back to ``holders``)::

    request:  {"id": 8, "method": "prefix", "params": {"keys": ["0a1b..", ...], "exclude": null}}
    response: {"id": 8, "result": {"holders": [["node-a", "dram"], ["node-b", "disk"]],
                                   "rows": [[0, 1], [0]], "runs": [[0, 3], [1, 1]]}}

``prefix`` also takes keys of one size packed into one hex string, ``"keys": {"hex": "0a1b..",
"size": 24}`` (what the client sends when its keys are all of a size: far cheaper to encode and
parse than a string per key).

Both ends authenticate each other first with a shared secret (HMAC-SHA256 challenge-response,
no secret on the wire)::

    server -> {"hello": "tpusync-registry", "version": 1, "nonce": hex(ns)}
    client -> {"nonce": hex(nc), "mac": hex(HMAC(secret, b"client" + ns + nc))}
    server -> {"mac": hex(HMAC(secret, b"server" + ns + nc))}     (or an error, then close)

Until it ends, a frame is at most 1 KiB and the whole handshake has one deadline; a server
runs every handshake on one thread and keeps a budget of them apart from its authenticated
connections (:mod:`tpusync._src.cluster._admission`). A server that sheds a connection for load
closes it, or answers ``{"error": {"type": "Busy", ...}}``; the client then tries once more.

The connection is not encrypted: run it on a trusted network (the MACs stop strangers from
using or impersonating the registry, not eavesdroppers from reading which blocks exist).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from typing import Any

from tpusync._src.cluster._handshake import _error, _ProtocolError, _recv_json, _send_json
from tpusync._src.cluster._handshake import is_loopback as is_loopback  # tpusync serve uses it
from tpusync._src.cluster.registry._wire import _holders_to_wire, _keys_from_hex, _keys_from_wire
from tpusync._src.cluster.registry.base import (
    Registry,
    check_exclude,
    check_node_id,
    check_tier,
    check_ttl,
    longest_prefix,
    node_from_dict,
    node_to_dict,
)
from tpusync._src.cluster.tcp_server import AuthenticatedTcpServer, ServerOptions, options_of
from tpusync.errors import InvalidArgumentError

__all__ = ["RegistryServer"]

log = logging.getLogger(__name__)


class RegistryServer(AuthenticatedTcpServer):
    """Serves ``registry`` to :class:`RemoteRegistry` clients that know ``secret``.

    Starts listening at once (``port=0``: a free port; see :attr:`address`); a thread per
    authenticated connection (handshakes share one). :meth:`close` stops it (the registry
    itself is left open: it is the caller's).

    Args:
      registry: any :class:`Registry` (its ``sweep()``, where it has one, is served too).
      host, port, and the other keywords (``secret`` among them), or ``options``: see
        :class:`~tpusync._src.cluster.tcp_server.ServerOptions`.
    """

    _label = "registry server"

    def __init__(
        self,
        registry: Registry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        options: ServerOptions | None = None,
        **keywords: Any,
    ) -> None:
        if not isinstance(registry, Registry):
            raise InvalidArgumentError(
                f"registry: expected a Registry, got {type(registry).__name__}"
            )
        if options is None:
            keywords.update(host=host, port=port)
        elif (host, port) != ("127.0.0.1", 0):
            keywords.update(host=host, port=port)  # refused by options_of: give one of them
        super().__init__(options_of(ServerOptions, options, keywords))
        self._registry = registry
        self._methods: dict[str, Callable[[dict[str, Any]], Any]] = {
            "ping": lambda p: "pong",
            "health": lambda p: self.health(),
            "register": self._register,
            "heartbeat": lambda p: registry.heartbeat(
                check_node_id(p.get("node_id")), check_ttl(p.get("ttl_s"))
            ),
            "unregister": lambda p: registry.unregister(check_node_id(p.get("node_id"))),
            "publish": lambda p: registry.publish(
                check_node_id(p.get("node_id")),
                _keys_from_hex(p.get("keys")),
                check_tier(p.get("tier")),
            ),
            "withdraw": lambda p: registry.withdraw(
                check_node_id(p.get("node_id")), _keys_from_hex(p.get("keys"))
            ),
            "holders": self._holders,
            "prefix": self._prefix,
            "nodes": lambda p: [node_to_dict(n) for n in registry.nodes()],
            "sweep": self._sweep,
        }
        self._start()

    def _holders(self, params: dict[str, Any]) -> Any:
        found = self._registry.holders(_keys_from_hex(params.get("keys")))
        if params.get("compact") is True:
            return _holders_to_wire(found)
        return [[[h.node_id, h.tier] for h in held] for held in found]

    def _prefix(self, params: dict[str, Any]) -> dict[str, Any]:
        keys = _keys_from_wire(params.get("keys"))
        exclude = check_exclude(params.get("exclude"))
        _, found = longest_prefix(self._registry, keys, exclude=exclude)
        return _holders_to_wire(found)

    def _register(self, params: dict[str, Any]) -> None:
        self._registry.register(node_from_dict(params.get("node")), check_ttl(params.get("ttl_s")))

    def _sweep(self, params: dict[str, Any]) -> int:
        sweep = getattr(self._registry, "sweep", None)
        if sweep is None:
            raise InvalidArgumentError(f"{type(self._registry).__name__} has no sweep()")
        return int(sweep())

    _thread_name = "tpusync-registry-server"

    def _serve_connection(self, conn: socket.socket) -> None:
        conn.settimeout(None)
        while not self._closed:
            try:
                request = _recv_json(conn)
            except _ProtocolError as exc:
                _send_json(conn, _error(None, "ProtocolError", str(exc)))
                if "exceeds" in str(exc):
                    return  # the oversized body is unread: the stream is lost
                continue
            _send_json(conn, self._handle(request))

    def _handle(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            return _error(None, "ProtocolError", "a request must be a JSON object")
        rid = request.get("id")
        if rid is not None and (type(rid) is not int or not 0 <= rid < 2**63):
            return _error(None, "ProtocolError", "id: expected an integer or null")
        method, params = request.get("method"), request.get("params", {})
        handler = self._methods.get(method) if isinstance(method, str) else None
        if handler is None:
            return _error(rid, "ProtocolError", f"unknown method {method!r:.100}")
        if not isinstance(params, dict):
            return _error(rid, "ProtocolError", "params: expected a JSON object")
        try:
            return {"id": rid, "result": handler(params)}
        except InvalidArgumentError as exc:
            return _error(rid, "InvalidArgumentError", str(exc))
        except Exception as exc:  # the registry failed: report it, keep serving
            log.warning("registry server: %s failed: %r", method, exc)
            return _error(rid, "ServerError", f"{type(exc).__name__}: {exc}")
