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
connections (:mod:`tpusync.cluster._admission`). A server that sheds a connection for load
closes it, or answers ``{"error": {"type": "Busy", ...}}``; the client then tries once more.

The connection is not encrypted: run it on a trusted network (the MACs stop strangers from
using or impersonating the registry, not eavesdroppers from reading which blocks exist).
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Sequence
from typing import Any

# The handshake and the server base live in modules of their own; the names other modules (and
# older code) import from here stay importable here.
from tpusync.cluster._handshake import (
    AuthenticationError,
    _check_secret,
    _error,
    _ProtocolError,
    _recv_json,
    _send_frame,
    _send_json,
    check_transport,
    client_handshake,
    parse_address,
    retry_if_shed,
)
from tpusync.cluster._handshake import is_loopback as is_loopback
from tpusync.cluster._tcp_server import MAX_HANDSHAKES, AuthenticatedTcpServer
from tpusync.cluster.registry import (
    MAX_KEY_BYTES,
    Holder,
    NodeInfo,
    Registry,
    check_exclude,
    check_keys,
    check_tier,
    check_ttl,
    longest_prefix,
    prefix_of,
)
from tpusync.errors import InvalidArgumentError, TpuSyncError

__all__ = [
    "AuthenticationError",
    "RegistryServer",
    "RegistryUnavailableError",
    "RemoteRegistry",
]

log = logging.getLogger(__name__)

BATCH_KEYS = 4096  # keys per request: far below MAX_FRAME even for 32-byte keys


class RegistryUnavailableError(TpuSyncError, ConnectionError):
    """The registry cannot be reached or did not answer (connection refused or lost, timeout,
    a server-side failure); the cause is chained."""


class _UnknownMethodError(RegistryUnavailableError):
    """The server does not know the method (it predates it)."""


# -- shared helpers (also used by the Redis and JAX backends) ------------------------------------


def check_node(node: NodeInfo) -> NodeInfo:
    """A NodeInfo whose fields all have the types the wire formats carry."""
    if not isinstance(node, NodeInfo):
        raise InvalidArgumentError(f"node: expected a NodeInfo, got {type(node).__name__}")
    if not isinstance(node.addresses, tuple | list) or not all(
        isinstance(a, str) for a in node.addresses
    ):
        raise InvalidArgumentError(
            f"node.addresses: expected a tuple of 'host:port' strings, got {node.addresses!r}"
        )
    if not isinstance(node.group, str):
        raise InvalidArgumentError(f"node.group: expected a string, got {node.group!r}")
    for name in ("shard_rank", "shard_count"):
        value = getattr(node, name)
        if type(value) is not int or value < (0 if name == "shard_rank" else 1):
            raise InvalidArgumentError(
                f"node.{name}: expected an integer >= {0 if name == 'shard_rank' else 1}, "
                f"got {value!r}"
            )
    return node


def check_node_id(node_id: str) -> str:
    if not isinstance(node_id, str) or not 1 <= len(node_id) <= 128:
        raise InvalidArgumentError(
            f"node_id: expected a string of 1 to 128 characters, got {node_id!r}"
        )
    return node_id


def node_to_dict(node: NodeInfo) -> dict[str, Any]:
    return {
        "node_id": node.node_id,
        "addresses": list(node.addresses),
        "group": node.group,
        "shard_rank": node.shard_rank,
        "shard_count": node.shard_count,
    }


def node_from_dict(data: Any, argument: str = "node") -> NodeInfo:
    """The NodeInfo of :func:`node_to_dict`'s output, every field type-checked."""
    if not isinstance(data, dict) or not isinstance(data.get("node_id"), str):
        raise InvalidArgumentError(f"{argument}: expected a node record, got {data!r:.200}")
    unknown = set(data) - {"node_id", "addresses", "group", "shard_rank", "shard_count"}
    if unknown:
        raise InvalidArgumentError(f"{argument}: unknown fields {sorted(unknown)}")
    addresses = data.get("addresses", [])
    if not isinstance(addresses, list):
        raise InvalidArgumentError(f"{argument}.addresses: expected a list, got {addresses!r}")
    node = NodeInfo(
        node_id=data["node_id"],
        addresses=tuple(addresses),
        group=data.get("group", ""),
        shard_rank=data.get("shard_rank", 0),
        shard_count=data.get("shard_count", 1),
    )
    return check_node(node)


def _keys_from_hex(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise InvalidArgumentError(f"keys: expected a list of hex strings, got {value!r:.200}")
    try:
        return check_keys([bytes.fromhex(item) for item in value])
    except (TypeError, ValueError):
        pass  # find which one, below
    out = []
    for i, item in enumerate(value):
        try:
            out.append(bytes.fromhex(item))
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"keys[{i}]: expected a hex string, got {item!r:.100}"
            ) from None
    return check_keys(out)


def _holders_to_wire(found: Sequence[Sequence[Holder]]) -> dict[str, Any]:
    """A lookup's answer in the compact wire form (see the module's docstring)."""
    table: list[list[str]] = []
    holder_at: dict[int, int] = {}  # id(holder) -> its index (the holders outlive this call)
    rows: list[list[int]] = []
    row_at: dict[tuple[int, ...], int] = {}  # the ids of a row's holders -> its index
    runs: list[list[int]] = []
    last: Any = None
    for held in found:
        if runs and (held is last or (len(held) == 1 and len(last) == 1 and held[0] is last[0])):
            runs[-1][1] += 1  # the same holders as the key before (the common case)
            continue
        last = held
        ids = tuple(map(id, held))
        r = row_at.get(ids)
        if r is None:
            row = []
            for h in held:
                i = holder_at.get(id(h))
                if i is None:
                    i = holder_at[id(h)] = len(table)
                    table.append([h.node_id, h.tier])
                row.append(i)
            r = row_at[ids] = len(rows)
            rows.append(row)
        if runs and runs[-1][0] == r:
            runs[-1][1] += 1
        else:
            runs.append([r, 1])
    return {"holders": table, "rows": rows, "runs": runs}


def _holders_from_wire(result: Any, method: str) -> list[list[Holder]]:
    """The compact wire form (or the plain one: a list per key of [node, tier]) as holder
    lists, each sorted by node id."""
    try:
        if isinstance(result, list):  # the plain form
            out = [
                sorted((Holder(str(n), str(t)) for n, t in held), key=_holder_node)
                for held in result
            ]
        else:
            table = [Holder(str(n), str(t)) for n, t in result["holders"]]
            rows = [sorted((table[i] for i in row), key=_holder_node) for row in result["rows"]]
            out = []
            for r, count in result["runs"]:
                row = rows[r]
                out.extend([row.copy() for _ in range(count)])
    except (TypeError, ValueError, KeyError, IndexError):
        raise RegistryUnavailableError(f"malformed {method} answer: {result!r:.200}") from None
    return out


def _holder_node(holder: Holder) -> str:
    return holder.node_id


def _keys_to_wire(keys: list[bytes]) -> Any:
    """Keys as the ``prefix`` method takes them: packed where they are all of a size."""
    sizes = set(map(len, keys))
    if len(sizes) == 1:
        return {"hex": b"".join(keys).hex(), "size": sizes.pop()}
    return [k.hex() for k in keys]


def _keys_from_wire(value: Any) -> list[bytes]:
    """The keys of a ``prefix`` request: a list of hex strings, or packed (one size)."""
    if not isinstance(value, dict):
        return _keys_from_hex(value)
    packed, size = value.get("hex"), value.get("size")
    if set(value) != {"hex", "size"} or not isinstance(packed, str) or type(size) is not int:
        raise InvalidArgumentError(f"keys: expected {{hex, size}}, got {value!r:.200}")
    if not 1 <= size <= MAX_KEY_BYTES:
        raise InvalidArgumentError(f"keys.size: expected 1 to {MAX_KEY_BYTES}, got {size}")
    try:
        raw = bytes.fromhex(packed)
    except ValueError:
        raise InvalidArgumentError(f"keys.hex: not hex: {packed!r:.100}") from None
    if len(raw) % size:
        raise InvalidArgumentError(f"keys.hex: {len(raw)} bytes, not a multiple of {size}")
    return list(struct.unpack(f"{size}s" * (len(raw) // size), raw))  # C speed: no slicing loop


# -- server --------------------------------------------------------------------------------------


class RegistryServer(AuthenticatedTcpServer):
    """Serves ``registry`` to :class:`RemoteRegistry` clients that know ``secret``.

    Starts listening at once (``port=0``: a free port; see :attr:`address`); a thread per
    authenticated connection (handshakes share one). :meth:`close` stops it (the registry
    itself is left open: it is the caller's).

    Args:
      registry: any :class:`Registry` (its ``sweep()``, where it has one, is served too).
      host, port: where to listen.
      secret: shared with the clients; at least 16 bytes (``secrets.token_bytes(32)``).
      handshake_timeout_s: the whole handshake must end within this, or the peer is dropped.
      max_connections: authenticated connections at most (beyond: the client is told "busy").
      max_handshakes: connections authenticating at most (beyond: the oldest is dropped).
    """

    _label = "registry server"

    def __init__(
        self,
        registry: Registry,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes,
        handshake_timeout_s: float = 10.0,
        max_connections: int = 256,
        max_handshakes: int = MAX_HANDSHAKES,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
    ) -> None:
        if not isinstance(registry, Registry):
            raise InvalidArgumentError(
                f"registry: expected a Registry, got {type(registry).__name__}"
            )
        super().__init__(
            host,
            port,
            secret=secret,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
            max_handshakes=max_handshakes,
            tls=tls,
            insecure=insecure,
        )
        self._registry = registry
        self._methods: dict[str, Callable[[dict[str, Any]], Any]] = {
            "ping": lambda p: "pong",
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


# -- client --------------------------------------------------------------------------------------


class RemoteRegistry:
    """A :class:`Registry` served by a :class:`RegistryServer` at ``address`` (``"host:port"``).

    Connects (and authenticates both ways) at once; one connection, used under a lock. A broken
    connection is re-made once per call; every socket operation times out after ``timeout_s``.

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
        self._host, self._port = parse_address(address)
        check_transport(self._host, tls, insecure, "address")
        self._tls = tls
        self._address = address
        self._secret = _check_secret(secret)
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise InvalidArgumentError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        self._timeout = float(timeout_s)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._closed = False
        self._no_prefix = False  # the server predates the "prefix" method
        with self._lock:
            self._connect()

    def _connect(self) -> None:
        retry_if_shed(self._connect_once)

    def _connect_once(self) -> None:
        try:
            sock = socket.create_connection((self._host, self._port), timeout=self._timeout)
        except OSError as exc:
            raise RegistryUnavailableError(
                f"cannot connect to the registry server at {self._address}: {exc}"
            ) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
            client_handshake(sock, self._secret, f"the registry server at {self._address}")
        except AuthenticationError:
            sock.close()
            raise
        except (OSError, EOFError, _ProtocolError) as exc:
            sock.close()
            raise RegistryUnavailableError(
                f"the registry server at {self._address} failed the handshake: {exc}"
            ) from exc
        self._sock = sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        with self._lock:
            if self._closed:
                raise RegistryUnavailableError("this RemoteRegistry was closed")
            self._next_id += 1
            rid = self._next_id
            payload = json.dumps({"id": rid, "method": method, "params": params}).encode()
            for attempt in range(2):
                if self._sock is None:
                    self._connect()
                sock = self._sock
                assert sock is not None
                try:
                    _send_frame(sock, payload)
                    response = _recv_json(sock)
                except TimeoutError as exc:
                    self._drop()
                    raise RegistryUnavailableError(
                        f"the registry server at {self._address} did not answer {method} "
                        f"within {self._timeout} s"
                    ) from exc
                except (OSError, EOFError) as exc:
                    self._drop()
                    if attempt == 0:
                        continue  # reconnect once
                    raise RegistryUnavailableError(
                        f"lost the connection to the registry server at {self._address}: {exc}"
                    ) from exc
                except _ProtocolError as exc:
                    self._drop()
                    raise RegistryUnavailableError(
                        f"the registry server at {self._address} broke the protocol: {exc}"
                    ) from exc
                break
        if not isinstance(response, dict) or response.get("id") != rid:
            with self._lock:
                self._drop()
            raise RegistryUnavailableError(
                f"the registry server at {self._address} answered out of turn: {response!r:.200}"
            )
        error = response.get("error")
        if error is not None:
            kind = error.get("type") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(error)
            if kind == "InvalidArgumentError":
                raise InvalidArgumentError(message)
            if kind == "ProtocolError" and str(message).startswith("unknown method"):
                raise _UnknownMethodError(
                    f"the registry server at {self._address} does not serve {method}: {message}"
                )
            raise RegistryUnavailableError(
                f"the registry server at {self._address} failed {method}: {message}"
            )
        return response.get("result")

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
        for i in range(0, max(len(keys), 1), BATCH_KEYS):
            batch = [k.hex() for k in keys[i : i + BATCH_KEYS]]
            self._call("publish", {"node_id": node_id, "keys": batch, "tier": tier})

    def withdraw(self, node_id: str, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys)
        check_node_id(node_id)
        for i in range(0, len(keys), BATCH_KEYS):
            batch = [k.hex() for k in keys[i : i + BATCH_KEYS]]
            self._call("withdraw", {"node_id": node_id, "keys": batch})

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        keys = check_keys(keys)
        out: list[list[Holder]] = []
        for i in range(0, len(keys), BATCH_KEYS):
            batch = keys[i : i + BATCH_KEYS]
            result = self._call("holders", {"keys": [k.hex() for k in batch], "compact": True})
            found = _holders_from_wire(result, "holders")
            if len(found) != len(batch):
                raise RegistryUnavailableError(f"malformed holders answer: {result!r:.200}")
            out.extend(found)
        return out

    def prefix_holders(
        self, keys: Sequence[bytes], *, exclude: str | None = None
    ) -> list[list[Holder]]:
        """See :meth:`~tpusync.cluster.registry.PrefixRegistry.prefix_holders`: one request
        (per 4096 keys) that the server answers for the leading keys only."""
        keys = check_keys(keys)
        check_exclude(exclude)
        out: list[list[Holder]] = []
        for i in range(0, len(keys), BATCH_KEYS):
            batch = keys[i : i + BATCH_KEYS]
            if self._no_prefix:
                return out + prefix_of(self.holders(keys[i:]), exclude)[1]
            params = {"keys": _keys_to_wire(batch), "exclude": exclude}
            try:
                result = self._call("prefix", params)
            except _UnknownMethodError:
                self._no_prefix = True
                return out + prefix_of(self.holders(keys[i:]), exclude)[1]
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
            self._drop()

    def __enter__(self) -> RemoteRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
