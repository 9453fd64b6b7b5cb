"""The TCP data plane: :class:`BlockServer` serves a HostPool's blocks to peers,
:class:`BlockClient` pulls them straight into a local HostPool's slots, :class:`RemotePool` is
the read side of the :class:`~tpusync.tiers.LowerTier` interface over a client.

Connection: TCP, then the registry's mutual HMAC-SHA256 handshake (same frames, same shared
secret rules: see :mod:`tpusync.cluster.registry_server`); nothing but the handshake is answered
before it succeeds. Then control requests are the registry's frames (4-byte big-endian length +
JSON object, ``{"id", "method", "params"}`` -> ``{"id", "result"}`` or ``{"id", "error"}``)::

    hello    {"protocol": "tpusync-blocks", "version": 1, "layout": {...} (optional)}
             -> {"protocol", "version", "server_id", "fingerprint" (hex), "payload_bytes",
                 "capacity", "lease_ttl_s", "writable" (accepts put)}
    acquire  {"keys": [hex, ...], "ttl_s": s}   -> {"lease", "present", "checksums", "ttl_s"}
    renew    {"lease": id, "ttl_s": s}          -> bool
    release  {"lease": id}                       -> bool (held the whole time)
    contains {"keys": [hex, ...]}                -> [bool, ...]
    stat     {}                                  -> {"capacity", "used"}
    get      {"lease": id, "keys": [hex, ...]}   -> binary frames, not JSON (see
             :mod:`tpusync.cluster.wire`): per key in order a BLOCK frame (header + payload) or
             a MISSING frame, then END; or an ERROR frame, which ends the response.

A pull (:meth:`BlockClient.pull`): reserve slots in the target for the keys it lacks, acquire a
lease on them (the server pins the present ones and hands out their recorded checksums), stripe
``get`` requests over the client's connections (one thread each), receive every payload with
``recv_into`` straight into its reserved slot, verify every block (header checksum = lease
checksum = checksum of the received bytes, fingerprint = the target's), release the lease, and
commit the verified blocks only if the release answered True (the lease never expired: see
:mod:`tpusync.cluster.leases` for the timing rule); everything else is aborted. A connection
that breaks, times out or breaks the format loses the blocks not yet complete on it (their
slots are aborted; the connection is re-made on the next pull).

The server pins the slots of every ``get`` while it sends them (on top of the lease's pins) and
sends each payload from a view of its slot (``sendmsg``, no copy).

With ``tls=ssl.SSLContext`` every connection is encrypted (required off loopback unless
``insecure=True``: the MACs stop strangers, not eavesdroppers). Store nodes add ``put``,
``delete`` and ``keys`` and bind each connection to the layout its hello names
(:mod:`tpusync.cluster.store_node`); a plain server answers ``hello`` with its own layout.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tpusync import _core
from tpusync.cluster import wire
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
from tpusync.cluster._tcp_server import MAX_HANDSHAKES, AuthenticatedTcpServer
from tpusync.cluster.frames import (
    FrameBatch,
    frame_receiver,
    send_buffers,
    slot_addresses,
    tune_for_peer,
)
from tpusync.cluster.leases import LeaseTable
from tpusync.cluster.registry import check_keys
from tpusync.errors import (
    BlocksMissingError,
    InvalidArgumentError,
    TpuSyncError,
)
from tpusync.tiers._pool_file import slot_checksums
from tpusync.tiers.host_pool import HostPool, Reservation
from tpusync.tiers.layout import PoolLayout
from tpusync.tiers.stats import TierStats

__all__ = [
    "BlockClient",
    "BlockServer",
    "PeerUnavailableError",
    "RemoteOperationUnsupportedError",
    "RemotePool",
]

log = logging.getLogger(__name__)

PROTOCOL = "tpusync-blocks"
VERSION = 1
MAX_KEYS_PER_REQUEST = 4096
MAX_ERROR_BYTES = 4096
DEADLINE_FRACTION = 0.8  # a pull's deadline: this share of the granted TTL (the timing rule)
TLS_HASH_STEP = 64 << 10  # bytes a TLS receive gathers before hashing them (as recv_exact)


class PeerUnavailableError(TpuSyncError, ConnectionError):
    """A block server cannot be reached, failed the handshake or did not answer; the cause is
    chained."""


class RemoteOperationUnsupportedError(TpuSyncError, NotImplementedError):
    """The remote tier does not offer this operation (yet): it is read-only."""


class _ConnectionLost(PeerUnavailableError):
    """The server closed or reset a connection (e.g. an idle one it timed out): worth one retry
    on a fresh connection."""


class _StreamError(Exception):
    """The block stream of one connection cannot continue (the connection is dropped)."""


# -- the handshake (the registry's, on the same primitives) --------------------------------------


# -- helpers ---------------------------------------------------------------------------------


def _keys_param(value: Any) -> list[bytes]:
    if not isinstance(value, list) or len(value) > MAX_KEYS_PER_REQUEST:
        raise InvalidArgumentError(
            f"keys: expected a list of at most {MAX_KEYS_PER_REQUEST} hex strings"
        )
    out = []
    for i, item in enumerate(value):
        try:
            out.append(bytes.fromhex(item))
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"keys[{i}]: expected a hex string") from None
    return check_keys(out)


def _lease_param(value: Any) -> int:
    if type(value) is not int or not 0 < value < 2**63:
        raise InvalidArgumentError(f"lease: expected a lease id, got {value!r:.50}")
    return value


def _ttl_param(value: Any, default: float, top: float) -> float:
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise InvalidArgumentError(f"ttl_s: expected seconds > 0, got {value!r:.50}")
    return min(float(value), top)


def _parse_path(text: str) -> tuple[tuple[str, int] | None, tuple[str, int]]:
    """``"remote"`` or ``"local>remote"``: remote is ``"host:port"``; local is a host (bound
    with port 0) or ``"host:port"`` / ``"[v6]:port"``."""
    if not isinstance(text, str):
        raise InvalidArgumentError(f"addresses: expected 'host:port' strings, got {text!r}")
    if ">" not in text:
        return None, parse_address(text)
    local, _, remote = text.partition(">")
    remote_address = parse_address(remote)
    host, port = local, "0"
    if local.startswith("[") or local.count(":") == 1:
        host, _, port = local.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgumentError(
            f"addresses: {text!r}: expected 'local>host:port' with a local host or host:port"
        )
    return (host, int(port)), remote_address


# -- server ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """What one connection of a server serves: a pool and the leases taken on it."""

    pool: HostPool
    leases: LeaseTable


class BlockServer(AuthenticatedTcpServer):
    """Serves ``pool``'s blocks to :class:`BlockClient` peers that know ``secret``.

    Listens at once (``port=0``: a free port; see :attr:`address`); a thread per authenticated
    connection (handshakes share one: :mod:`tpusync.cluster._admission`).
    :meth:`close` stops it and releases every lease (the pool stays open: it is the caller's).

    Args:
      pool: the HostPool whose committed blocks are served.
      secret: shared with the clients; at least 16 bytes.
      host, port: where to listen.
      lease_ttl_s: the longest lease granted (a client may ask for less).
      handshake_timeout_s: the whole handshake (TLS included) must end within this, or the
        peer is dropped.
      io_timeout_s: a connection idle (or stuck sending) this long is closed.
      max_connections: authenticated connections at most (beyond: the client is told "busy").
      max_handshakes: connections authenticating at most, kept apart from the authenticated
        ones (beyond: the oldest unauthenticated one is dropped).
      clock: the lease table's clock (tests).
      before_lease: called with the keys a peer asks to lease, before the lease is taken (a
        store moves blocks up from its lower tiers into ``pool`` there); failures are logged
        and the keys it could not bring are simply absent.
    """

    def __init__(
        self,
        pool: HostPool,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_ttl_s: float = 10.0,
        handshake_timeout_s: float = 10.0,
        io_timeout_s: float = 300.0,
        max_connections: int = 256,
        clock: Callable[[], float] = time.monotonic,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        before_lease: Callable[[list[bytes]], None] | None = None,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(f"pool: expected a HostPool, got {type(pool).__name__}")
        self._listen(host, port, secret, lease_ttl_s, handshake_timeout_s, io_timeout_s,
                     max_connections, tls, insecure, max_handshakes=max_handshakes)  # fmt: skip
        self.pool = pool
        try:
            self.leases = LeaseTable(pool, clock=clock)
        except BaseException:
            self._sock.close()  # listening already: give the port back
            raise
        self._served = Served(pool, self.leases)
        self._before_lease = before_lease
        self._start()

    def _listen(
        self,
        host: str,
        port: int,
        secret: bytes,
        lease_ttl_s: float,
        handshake_timeout_s: float,
        io_timeout_s: float,
        max_connections: int,
        tls: ssl.SSLContext | None,
        insecure: bool,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        """Checks the server arguments and starts listening (what every block server shares;
        :meth:`_start` then starts accepting)."""
        _check_secret(secret)
        if not isinstance(lease_ttl_s, int | float) or not 0 < lease_ttl_s <= 3600:
            raise InvalidArgumentError(f"lease_ttl_s: expected (0, 3600] s, got {lease_ttl_s!r}")
        AuthenticatedTcpServer.__init__(
            self,
            host,
            port,
            secret=secret,
            handshake_timeout_s=handshake_timeout_s,
            max_connections=max_connections,
            max_handshakes=max_handshakes,
            tls=tls,
            insecure=insecure,
        )
        self.lease_ttl_s = float(lease_ttl_s)
        self.server_id = secrets.token_hex(8)
        self._io_timeout = float(io_timeout_s)

    _thread_name = "tpusync-block-server"
    _label = "block server"
    _before_lease: Callable[[list[bytes]], None] | None = None

    def _serve_connection(self, conn: socket.socket) -> None:
        conn.settimeout(self._io_timeout)
        tune_for_peer(conn)
        served = self._initial_binding()
        streams = self._streams()
        while not self._closed:
            request = _recv_json(conn)
            method = request.get("method") if isinstance(request, dict) else None
            if isinstance(method, str) and method in streams:
                rid = request.get("id")
                params = request.get("params")
                if type(rid) is not int or not 0 <= rid < 2**64 or not isinstance(params, dict):
                    _send_json(conn, _error(None, "ProtocolError", f"{method}: bad id or params"))
                    return
                if served is None:
                    _send_json(conn, _error(rid, "ProtocolError", f"{method}: say hello first"))
                    return
                if not streams[method](conn, served, rid, params):
                    return
                continue
            response, served = self._handle(request, served)
            _send_json(conn, response)

    def _initial_binding(self) -> Served | None:
        """What a new connection serves before its hello (None: nothing until then)."""
        return self._served

    def _bind(self, params: dict[str, Any], served: Served | None) -> Served:
        """What a connection serves after its hello with ``params`` (a hook for servers of
        several pools; this one serves its pool whatever the client's layout: the client
        compares fingerprints)."""
        return self._served

    def _streams(self) -> dict[str, Callable[[socket.socket, Served, int, dict[str, Any]], bool]]:
        """Requests answered with binary frames (or followed by them), by method."""
        return {"get": self._handle_get}

    def _handlers(self, served: Served) -> dict[str, Callable[[dict[str, Any]], Any]]:
        """The JSON requests of a connection serving ``served``, by method (hello apart)."""
        return {
            "acquire": lambda p: self._acquire(served, p),
            "renew": lambda p: self._renew(served, p),
            "release": lambda p: served.leases.release(_lease_param(p.get("lease"))),
            "contains": lambda p: served.pool.contains(_keys_param(p.get("keys"))),
            "stat": lambda p: {"capacity": served.pool.capacity, "used": served.pool.used},
        }

    def _handle(self, request: Any, served: Served | None) -> tuple[dict[str, Any], Served | None]:
        if not isinstance(request, dict):
            return _error(None, "ProtocolError", "a request must be a JSON object"), served
        rid = request.get("id")
        if rid is not None and (type(rid) is not int or not 0 <= rid < 2**63):
            return _error(None, "ProtocolError", "id: expected an integer or null"), served
        method, params = request.get("method"), request.get("params", {})
        if not isinstance(params, dict):
            return _error(rid, "ProtocolError", "params: expected a JSON object"), served
        try:
            if method == "hello":
                result, served = self._hello(params, served)
                return {"id": rid, "result": result}, served
            if served is None:
                return _error(rid, "ProtocolError", f"{method!r:.50}: say hello first"), served
            handler = self._handlers(served).get(method if isinstance(method, str) else "")
            if handler is None:
                return _error(rid, "ProtocolError", f"unknown method {method!r:.100}"), served
            return {"id": rid, "result": handler(params)}, served
        except InvalidArgumentError as exc:
            return _error(rid, "InvalidArgumentError", str(exc)), served
        except Exception as exc:
            log.warning("block server: %s failed: %r", method, exc)
            return _error(rid, "ServerError", f"{type(exc).__name__}: {exc}"), served

    def _hello(
        self, params: dict[str, Any], served: Served | None
    ) -> tuple[dict[str, Any], Served]:
        if params.get("protocol") != PROTOCOL or params.get("version") != VERSION:
            raise InvalidArgumentError(
                f"this server speaks {PROTOCOL} version {VERSION}, not "
                f"{params.get('protocol')!r:.50} version {params.get('version')!r:.20}"
            )
        served = self._bind(params, served)
        layout = served.pool.layout
        return {
            "protocol": PROTOCOL,
            "version": VERSION,
            "server_id": self.server_id,
            "fingerprint": layout.fingerprint.hex(),
            "payload_bytes": layout.payload_bytes,
            "capacity": served.pool.capacity,
            "lease_ttl_s": self.lease_ttl_s,
            "writable": "put" in self._streams(),
        }, served

    def _acquire(self, served: Served, params: dict[str, Any]) -> dict[str, Any]:
        keys = _keys_param(params.get("keys"))
        ttl = _ttl_param(params.get("ttl_s"), self.lease_ttl_s, self.lease_ttl_s)
        hook = self._before_lease
        if hook is not None:
            try:
                hook(keys)
            except Exception as exc:  # the keys it did not bring are absent: misses, not errors
                log.warning("block server: preparing %d keys failed: %r", len(keys), exc)
        lease = served.leases.acquire(keys, ttl)
        self._read(served, [k for k, p in zip(keys, lease.present, strict=True) if p])
        return {
            "lease": lease.lease_id,
            "present": lease.present,
            "checksums": lease.checksums,
            "ttl_s": lease.ttl_s,
        }

    def _read(self, served: Served, keys: list[bytes]) -> None:
        """Told of the keys a peer is about to read (a hook for servers that keep an LRU)."""

    def _renew(self, served: Served, params: dict[str, Any]) -> bool:
        ttl = _ttl_param(params.get("ttl_s"), self.lease_ttl_s, self.lease_ttl_s)
        return served.leases.renew(_lease_param(params.get("lease")), ttl)

    def _send_error(self, conn: socket.socket, served: Served, rid: int, message: str) -> None:
        data = message.encode("utf-8", "replace")[:MAX_ERROR_BYTES]
        header = wire.encode_header(
            wire.ERROR, rid, b"", served.pool.layout.fingerprint, payload_length=len(data)
        )
        send_buffers(conn, [header, data])

    def _handle_get(
        self, conn: socket.socket, served: Served, rid: int, params: dict[str, Any]
    ) -> bool:
        """Answers one ``get`` with block frames; False when the connection must close."""
        pool = served.pool
        try:
            lease = served.leases.lookup(_lease_param(params.get("lease")))
            keys = _keys_param(params.get("keys"))
        except InvalidArgumentError as exc:
            self._send_error(conn, served, rid, str(exc))
            return True
        if lease is None:
            self._send_error(conn, served, rid, "lease: unknown or expired; acquire a new one")
            return True
        leased = {k for k, p in zip(lease.keys, lease.present, strict=True) if p}
        layout = pool.layout
        fingerprint, size = layout.fingerprint, layout.payload_bytes
        try:
            pinned = pool.pin(keys)  # held while sending, whatever the lease does
        except InvalidArgumentError as exc:  # e.g. the pool was closed
            self._send_error(conn, served, rid, str(exc))
            return True
        # Frames go out SEND_BATCH_BYTES at a time, one GIL-free sendmsg loop each (a block at
        # a time cost ~1.8x the server's CPU per byte at 128 KiB blocks). A subclass that
        # overrides _send_block (tests that pace or damage frames) gets it called per block.
        hooked = type(self)._send_block is not BlockServer._send_block
        batch = FrameBatch(conn, pool)
        try:
            pool._ensure_populated(pinned.slots[pinned.present])  # pages the views will read
            for key, slot, present, checksum in zip(
                keys,
                pinned.slots.tolist(),
                pinned.present.tolist(),
                pinned.checksums.tolist(),
                strict=True,
            ):
                if not present or key not in leased:
                    batch.add(wire.encode_header(wire.MISSING, rid, key, fingerprint))
                    continue
                header = wire.encode_header(
                    wire.BLOCK, rid, key, fingerprint, payload_length=size, checksum=checksum
                )
                if hooked:
                    batch.flush()
                    with pool.slot_memory(slot) as memory, memory[:size] as payload:
                        self._send_block(conn, header, payload)
                else:
                    batch.add(header, slot)
            batch.add(wire.encode_header(wire.END, rid, b"", fingerprint))
            batch.flush()
        finally:
            batch.release()
            pool.unpin(pinned)
        return True

    def _send_block(self, conn: socket.socket, header: bytes, payload: memoryview) -> None:
        """Sends one BLOCK frame (a hook for tests that damage frames)."""
        send_buffers(conn, [header, payload])

    def close(self) -> None:
        """Stops accepting, closes every connection, waits (briefly) for their threads and
        releases every lease."""
        super().close()
        self.leases.close()


# -- client ----------------------------------------------------------------------------------


class _Connection:
    """One path to the server: a socket (bound to ``local`` when given) and its request ids."""

    def __init__(
        self,
        local: tuple[str, int] | None,
        remote: tuple[str, int],
        label: str,
        secret: bytes,
        timeout: float,
        tls: ssl.SSLContext | None = None,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.local, self.remote, self.label = local, remote, label
        self._secret, self._timeout, self._tls = secret, timeout, tls
        self._layout = layout
        self.sock: socket.socket | None = None
        self.hello: dict[str, Any] = {}
        self._next_id = 0

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def ensure(self) -> None:
        """Connects (or re-connects a socket the server closed meanwhile)."""
        if self.sock is not None and not self._alive(self.sock):
            self.drop()
        if self.sock is None:
            self.connect()

    @staticmethod
    def _alive(sock: socket.socket) -> bool:
        """False when the server closed the socket (or left bytes nobody asked for)."""
        if isinstance(sock, ssl.SSLSocket):
            return True  # no peeking through TLS: a closed one fails on use and is retried
        try:
            sock.setblocking(False)
            try:
                sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return True  # nothing pending: idle and open
            finally:
                sock.setblocking(True)
        except OSError:
            pass
        return False

    def connect(self) -> None:
        retry_if_shed(self._connect_once)

    def _connect_once(self) -> None:
        try:
            sock = socket.create_connection(
                self.remote, timeout=self._timeout, source_address=self.local
            )
        except OSError as exc:
            raise PeerUnavailableError(
                f"cannot connect to the block server at {self.label}: {exc}"
            ) from exc
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self.remote[0])
            tune_for_peer(sock)  # for pushes
            client_handshake(sock, self._secret, f"the block server at {self.label}")
            self.sock = sock
            params: dict[str, Any] = {"protocol": PROTOCOL, "version": VERSION}
            if self._layout is not None:
                params["layout"] = self._layout
            hello = self.call("hello", params)
            if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
                raise _ProtocolError(f"not a tpusync block server: {hello!r:.200}")
            self.hello = hello
        except (AuthenticationError, InvalidArgumentError):  # e.g. a layout the server refused
            self.drop(sock)
            raise
        except (OSError, EOFError, _ProtocolError, PeerUnavailableError) as exc:
            self.drop(sock)
            if isinstance(exc, PeerUnavailableError):
                raise
            raise PeerUnavailableError(
                f"the block server at {self.label} failed the handshake: {exc}"
            ) from exc

    def drop(self, sock: socket.socket | None = None) -> None:
        sock = sock or self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        self.sock = None

    def call(self, method: str, params: dict[str, Any]) -> Any:
        """One JSON request and its answer. Raises PeerUnavailableError (the connection is
        dropped) or InvalidArgumentError (the server refused the arguments)."""
        sock = self.sock
        if sock is None:
            raise PeerUnavailableError(f"not connected to {self.label}")
        rid = self.next_id()
        try:
            sock.settimeout(self._timeout)
            _send_json(sock, {"id": rid, "method": method, "params": params})
            response = _recv_json(sock)
        except (OSError, EOFError, _ProtocolError) as exc:
            self.drop()
            lost = isinstance(exc, EOFError | ConnectionError)
            raise (_ConnectionLost if lost else PeerUnavailableError)(
                f"the block server at {self.label} did not answer {method}: {exc!r}"
            ) from exc
        if not isinstance(response, dict) or response.get("id") != rid:
            self.drop()
        return self._result(response, rid, method, PeerUnavailableError)

    def _result(self, response: Any, rid: int, method: str, failure: type[Exception]) -> Any:
        """The result of the answer to request ``rid``: InvalidArgumentError when the server
        refused the arguments, ``failure`` when it answered out of turn or failed."""
        if not isinstance(response, dict) or response.get("id") != rid:
            raise failure(
                f"the block server at {self.label} answered out of turn: {response!r:.200}"
            )
        error = response.get("error")
        if error is not None:
            kind = error.get("type") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(error)
            if kind == "InvalidArgumentError":
                raise InvalidArgumentError(f"{self.label}: {message}")
            raise failure(f"the block server at {self.label} failed {method}: {message}")
        return response.get("result")

    def send_get(self, lease_id: int, keys: Sequence[bytes]) -> int:
        assert self.sock is not None
        rid = self.next_id()
        body = {
            "id": rid,
            "method": "get",
            "params": {"lease": lease_id, "keys": [k.hex() for k in keys]},
        }
        _send_frame(self.sock, json.dumps(body, separators=(",", ":")).encode())
        return rid

    def send_put(self, keys: Sequence[bytes], checksums: Sequence[int]) -> tuple[int, Any]:
        """Sends a ``put`` request and returns its id and the server's answer (which keys it
        wants); the blocks follow with :meth:`send_block`, then :meth:`finish_put`."""
        assert self.sock is not None
        rid = self.next_id()
        body = {
            "id": rid,
            "method": "put",
            "params": {"keys": [k.hex() for k in keys], "checksums": [int(c) for c in checksums]},
        }
        self.sock.settimeout(self._timeout)
        _send_frame(self.sock, json.dumps(body, separators=(",", ":")).encode())
        return rid, self._answer(rid, "put")

    def _answer(self, rid: int, method: str) -> Any:
        """Reads the JSON answer to ``rid`` in the middle of a put's stream."""
        assert self.sock is not None
        return self._result(_recv_json(self.sock), rid, method, _StreamError)

    def finish_put(self, rid: int, fingerprint: bytes) -> Any:
        """Ends a put's blocks and returns the server's answer (which keys it stored)."""
        assert self.sock is not None
        self.sock.sendall(wire.encode_header(wire.END, rid, b"", fingerprint))
        return self._answer(rid, "put")

    def recv_into(
        self,
        view: memoryview,
        deadline: float | _Deadline,
        hasher: _core.PieceHasher | None = None,
    ) -> None:
        """Fills ``view`` from the socket before ``deadline`` (monotonic; a :class:`_Deadline`
        is read again at every wait, so lease renewals move it on), feeding ``hasher`` with the
        bytes as they land (under TLS 64 KiB at a time: after a failure it may lag behind)."""
        assert self.sock is not None
        got, n = 0, view.nbytes
        native = not isinstance(self.sock, ssl.SSLSocket)  # TLS decrypts in Python's ssl
        timeout_set: float | None = None  # what the TLS socket waits at most, as last set
        fed = 0  # TLS: bytes hashed so far
        while got < n:
            at = deadline.at if isinstance(deadline, _Deadline) else deadline
            left = at - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    "the pull's deadline passed (its lease could not be renewed in time)"
                )
            wait = min(self._timeout, left)
            if native:  # one GIL-free call per payload, not one Python round trip per read
                r = _core.recv_exact(self.sock.fileno(), view[got:], wait, hasher)
                got += r
                if got < n and wait >= self._timeout:
                    raise TimeoutError(f"{self.label} sent nothing for {self._timeout:g} s")
                continue
            if wait != timeout_set:
                # settimeout is a system call; a TLS read returns one record (16 KiB), so it
                # changes only in the last I/O timeout before the deadline (or when it moves)
                self.sock.settimeout(wait)
                timeout_set = wait
            try:
                r = self.sock.recv_into(view[got:], n - got)
            except TimeoutError:
                if left < self._timeout:
                    continue  # the deadline's turn: the check above names it (or it moved)
                raise TimeoutError(f"{self.label} sent nothing for {self._timeout:g} s") from None
            if r == 0:
                raise EOFError("connection closed by the server")
            got += r
            if hasher is not None and (got - fed >= TLS_HASH_STEP or got == n):
                # a record (16 KiB) at a time hashed slower and cost a call each: ~+13% TLS
                # pulls hashing 64 KiB at a time (median of 5 A/B runs, noisy)
                hasher.feed(view[fed:got])
                fed = got

    def receive_frames(self, receiver: _core.FrameReceiver, deadline: _Deadline) -> int:
        """Runs ``receiver`` until it is done or stops at a frame it did not expect, within
        ``deadline`` (read again at every wait) and the connection's I/O timeout."""
        while True:
            left = deadline.at - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    "the pull's deadline passed (its lease could not be renewed in time)"
                )
            status = receiver.run(left, self._timeout)
            if status == _core.FRAMES_SILENT:
                raise TimeoutError(f"{self.label} sent nothing for {self._timeout:g} s")
            if status != _core.FRAMES_TIMEOUT:  # else: the deadline's turn (it may have moved)
                return status


class _Deadline:
    """A pull's receive deadline (monotonic seconds), moved on by each lease renewal."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at


@dataclass
class PullResult:
    """What a pull did: ``loaded[i]`` for ``keys[i]``; ``corrupt`` blocks failed verification;
    ``error`` is the first transport or protocol failure (None when there was none);
    ``released`` is False when the lease lapsed (then nothing was committed)."""

    loaded: list[bool]
    corrupt: int = 0
    error: BaseException | None = None
    released: bool = True
    bytes_received: int = field(default=0)


class _Stripe:
    """One connection's share of a pull: its blocks' keys, reserved slots and recorded
    checksums, and what arrived (``ok``: verified, ``complete``: received whole, both over the
    whole reservation)."""

    def __init__(
        self, reservation: Reservation, indices: np.ndarray, expected: np.ndarray, target: HostPool
    ) -> None:
        self.indices = indices
        self.keys = [reservation.keys[i] for i in indices.tolist()]
        self.slots = np.asarray(reservation.slots, dtype=np.int64)[indices]
        self.expected = np.ascontiguousarray(np.asarray(expected, dtype=np.uint64)[indices])
        self.target = target
        self.size = target.layout.payload_bytes
        self.limit = max(self.size, MAX_ERROR_BYTES)
        n = len(reservation.keys)
        self.ok = np.zeros(n, dtype=bool)
        self.complete = np.zeros(n, dtype=bool)
        self.nbytes = 0

    def receiver(self, conn: _Connection, rid: int, addresses: np.ndarray) -> _core.FrameReceiver:
        assert conn.sock is not None
        return frame_receiver(
            conn.sock, rid, self.keys, self.target.layout, self.expected, addresses
        )

    def take_results(self, receiver: _core.FrameReceiver) -> None:
        """Adds what ``receiver`` received (its blocks verified or failed) to the stripe's."""
        results = receiver.results
        self.complete[self.indices[results != 0]] = True
        self.ok[self.indices[results == 1]] = True
        self.nbytes += receiver.bytes_received

    def receive_block(
        self, conn: _Connection, j: int, header: wire.FrameHeader, deadline: _Deadline
    ) -> None:
        """Receives block ``j``'s payload into its slot, hashed piece by piece as it lands
        (while its bytes are still in cache), and judges it."""
        layout = self.target.layout
        i, expected = int(self.indices[j]), int(self.expected[j])
        hasher = _core.PieceHasher(*layout.piece_table)
        with self.target.slot_memory(int(self.slots[j])) as memory, memory[: self.size] as payload:
            conn.recv_into(payload, deadline, hasher)
        self.nbytes += self.size
        self.complete[i] = True
        self.ok[i] = (
            header.fingerprint == layout.fingerprint
            and header.checksum == expected
            and hasher.complete
            and int(slot_checksums(hasher.digests[None, :])[0]) == expected
        )


class BlockClient:
    """Pulls blocks from one :class:`BlockServer` into local HostPools.

    Give ``address`` (``"host:port"``) or ``addresses`` (paths to the same server: each
    ``"host:port"`` or ``"local>host:port"``, where the local address is bound before
    connecting, e.g. ``"10.0.1.5>10.0.1.9:7000"`` to use one NIC per path); ``connections``
    (default: one per address) sockets are opened, path ``i % len(addresses)`` each, and a pull's
    keys are striped over them, one thread per connection.

    Connects and authenticates at once. ``timeout_s`` bounds every socket operation;
    ``lease_ttl_s`` is asked of the server (which may grant less); a pull stops receiving after
    DEADLINE_FRACTION of the granted TTL (the timing rule of :mod:`tpusync.cluster.leases`).
    One pull or push at a time per client (calls are serialized).

    ``layout`` names the block layout this client moves; a server of several layouts (a store
    node, :mod:`tpusync.cluster.store_node`) serves that one, and a plain BlockServer ignores it
    (pulls compare fingerprints). :meth:`push` needs a server that accepts blocks (a store node).

    Raises:
      AuthenticationError: the server and this client do not share ``secret``.
      PeerUnavailableError: the server cannot be reached or is not a block server.
      InvalidArgumentError: the addresses lead to different servers.
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        addresses: Sequence[str] | None = None,
        connections: int | None = None,
        secret: bytes,
        timeout_s: float = 10.0,
        lease_ttl_s: float | None = None,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
        layout: PoolLayout | None = None,
    ) -> None:
        if (address is None) == (addresses is None):
            raise InvalidArgumentError("address, addresses: give exactly one of them")
        paths_text = [address] if address is not None else list(addresses or [])
        if not paths_text:
            raise InvalidArgumentError("addresses: expected at least one address")
        paths = [_parse_path(p) for p in paths_text]
        for _, remote in paths:
            check_transport(remote[0], tls, insecure, "addresses")
        count = len(paths) if connections is None else connections
        if type(count) is not int or not 1 <= count <= 64:
            raise InvalidArgumentError(f"connections: expected 1 to 64, got {connections!r}")
        self._secret = _check_secret(secret)
        if not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise InvalidArgumentError(f"timeout_s: expected seconds > 0, got {timeout_s!r}")
        if lease_ttl_s is not None and (
            not isinstance(lease_ttl_s, int | float) or not 0 < lease_ttl_s <= 3600
        ):
            raise InvalidArgumentError(f"lease_ttl_s: expected (0, 3600] s, got {lease_ttl_s!r}")
        if layout is not None and not isinstance(layout, PoolLayout):
            raise InvalidArgumentError(
                f"layout: expected a PoolLayout or None, got {type(layout).__name__}"
            )
        self._timeout = float(timeout_s)
        self._ttl = lease_ttl_s
        self._lock = threading.Lock()
        described = None if layout is None else layout.describe()
        self._conns = [
            _Connection(
                *paths[i % len(paths)],
                paths_text[i % len(paths)],
                secret,
                self._timeout,
                tls,
                described,
            )
            for i in range(count)
        ]
        self.label = paths_text[0]
        self._executor = ThreadPoolExecutor(max_workers=count, thread_name_prefix="tpusync-pull")
        # Lease renewals during a pull go over a connection of their own: the others stream.
        self._control = _Connection(*paths[0], paths_text[0], secret, self._timeout, tls, described)
        self._closed = False
        self.server_id: str | None = None
        try:
            for conn in self._conns:
                conn.connect()
                self._check_same_server(conn)
        except BaseException:
            self.close()
            raise
        hello = self._conns[0].hello
        self.fingerprint = bytes.fromhex(str(hello.get("fingerprint", "")))
        self.payload_bytes = int(hello.get("payload_bytes", 0))
        self.server_capacity = int(hello.get("capacity", 0))
        self.writable = hello.get("writable") is True

    def _check_same_server(self, conn: _Connection) -> None:
        server_id = conn.hello.get("server_id")
        if self.server_id is None:
            self.server_id = server_id
        elif server_id != self.server_id:
            raise InvalidArgumentError(
                f"addresses: {conn.label} leads to another block server than {self.label}; "
                "every path of a client must reach the same server"
            )

    def _ensure(self, conn: _Connection) -> None:
        conn.ensure()
        self._check_same_server(conn)

    # --- queries ----------------------------------------------------------------------------

    def _request(self, conn: _Connection, method: str, params: dict[str, Any]) -> Any:
        """One control request on ``conn``, retried once on a fresh connection when the server
        had closed the old one. (A retried ``acquire`` may leave a lease to expire; a retried
        ``release`` answers False, and the pull is discarded: both safe.)"""
        self._ensure(conn)
        try:
            return conn.call(method, params)
        except _ConnectionLost:
            self._ensure(conn)
            return conn.call(method, params)

    def _call(self, method: str, params: dict[str, Any]) -> Any:
        with self._lock:
            self._check_open()
            return self._request(self._conns[0], method, params)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys)
        out: list[bool] = []
        for i in range(0, len(keys), MAX_KEYS_PER_REQUEST):
            batch = keys[i : i + MAX_KEYS_PER_REQUEST]
            result = self._call("contains", {"keys": [k.hex() for k in batch]})
            if not isinstance(result, list) or len(result) != len(batch):
                raise PeerUnavailableError(f"malformed contains answer: {result!r:.200}")
            out.extend(bool(x) for x in result)
        return out

    def stat(self) -> dict[str, int]:
        result = self._call("stat", {})
        if not isinstance(result, dict):
            raise PeerUnavailableError(f"malformed stat answer: {result!r:.200}")
        return {"capacity": int(result.get("capacity", 0)), "used": int(result.get("used", 0))}

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgumentError("this BlockClient is closed")

    # --- pull -------------------------------------------------------------------------------

    def pull(self, keys: Sequence[bytes], target: HostPool) -> list[bool]:
        """Copies the server's blocks under ``keys`` into ``target``; returns for each key
        whether ``target`` now holds it (keys it already held count as True).

        A key is False when the server lacks it, its block failed verification, the lease
        lapsed (see the module docstring), or the connection carrying it broke before the block
        was complete. Raises InvalidArgumentError (another block layout),
        :class:`~tpusync.errors.TierFullError` (too few free slots in ``target``; nothing is
        moved), AuthenticationError, or PeerUnavailableError when no lease could be taken.
        """
        return self.pull_result(keys, target).loaded

    def pull_result(self, keys: Sequence[bytes], target: HostPool) -> PullResult:
        """:meth:`pull`, with the counts and the first failure (see :class:`PullResult`)."""
        keys = check_keys(keys)
        self._check_pool(target, "target")
        total = PullResult(loaded=[])
        loaded: dict[bytes, bool] = {}
        with self._lock:
            self._check_open()
            unique = list(dict.fromkeys(keys))
            for i in range(0, len(unique), MAX_KEYS_PER_REQUEST):
                part = self._pull_batch(unique[i : i + MAX_KEYS_PER_REQUEST], target, loaded)
                total.corrupt += part.corrupt
                total.bytes_received += part.bytes_received
                total.released = total.released and part.released
                total.error = total.error or part.error
        total.loaded = [loaded.get(k, False) for k in keys]
        return total

    def _pull_batch(
        self, keys: list[bytes], target: HostPool, loaded: dict[bytes, bool]
    ) -> PullResult:
        result = PullResult(loaded=[])
        reservation = target.reserve(keys)  # TierFullError: nothing taken
        reserved = set(reservation.keys)
        others = [k for k in keys if k not in reserved]
        if others:
            loaded.update(zip(others, target.contains(others), strict=True))
        if not reservation.keys:
            return result
        n = len(reservation.keys)
        good = np.zeros(n, dtype=bool)
        jobs: list[Future[Any]] = []
        try:
            lease_conn = self._conns[0]
            start = time.monotonic()
            params: dict[str, Any] = {"keys": [k.hex() for k in reservation.keys]}
            if self._ttl is not None:
                params["ttl_s"] = self._ttl
            lease = self._request(lease_conn, "acquire", params)
            lease_id, present, expected, ttl = _check_lease(lease, n)
            deadline = _Deadline(start + ttl * DEADLINE_FRACTION)
            wanted = np.flatnonzero(present)
            stripes = [wanted[c :: len(self._conns)] for c in range(len(self._conns))]
            jobs += [
                self._executor.submit(
                    self._receive_stripe,
                    conn,
                    lease_id,
                    reservation,
                    stripe,
                    expected,
                    target,
                    deadline,
                )
                for conn, stripe in zip(self._conns, stripes, strict=True)
                if len(stripe)
            ]
            self._keep_lease(jobs, lease_id, ttl, deadline)
            wait(jobs)  # every stripe has stopped writing into the slots
            for job in jobs:
                ok, corrupt, nbytes, error = job.result()
                good |= ok
                result.corrupt += corrupt
                result.bytes_received += nbytes
                result.error = result.error or error
            try:
                released = self._request(lease_conn, "release", {"lease": lease_id}) is True
            except (PeerUnavailableError, InvalidArgumentError) as exc:
                released = False
                result.error = result.error or exc
            result.released = released
            if not released:
                if good.any():
                    log.warning(
                        "tpusync: pull from %s: the lease lapsed before its release; "
                        "discarding %d received blocks",
                        self.label,
                        int(good.sum()),
                    )
                good[:] = False
        except BaseException:
            wait(jobs)  # no stripe writes into a slot once it is aborted
            target.abort(reservation)
            raise
        if (~good).any():
            target.abort(reservation.subset(~good))
        if good.any():
            target.commit(reservation.subset(good), expected[good])
        loaded.update(zip(reservation.keys, good.tolist(), strict=True))
        if result.error is not None:
            log.warning("tpusync: pull from %s: %s", self.label, result.error)
        return result

    def _keep_lease(
        self, jobs: list[Future[Any]], lease_id: int, ttl: float, deadline: _Deadline
    ) -> None:
        """Renews the lease every third of its TTL until the stripes are done, moving their
        deadline on after each renewal the server grants (the timing rule holds per renewal:
        the deadline stays DEADLINE_FRACTION of a TTL after the renewal was asked). Stops
        renewing at the first refusal or failure; the stripes then stop at the deadline."""
        while True:
            _, pending = wait(jobs, timeout=ttl / 3)
            if not pending:
                return
            asked = time.monotonic()
            try:
                granted = self._request(self._control, "renew", {"lease": lease_id, "ttl_s": ttl})
            except (PeerUnavailableError, InvalidArgumentError) as exc:
                log.warning("tpusync: pull from %s: renewing the lease failed: %s", self.label, exc)
                return
            if granted is not True:
                log.warning(
                    "tpusync: pull from %s: the server refused to renew the lease", self.label
                )
                return
            deadline.at = asked + ttl * DEADLINE_FRACTION

    def _receive_stripe(
        self,
        conn: _Connection,
        lease_id: int,
        reservation: Reservation,
        indices: np.ndarray,
        expected: np.ndarray,
        target: HostPool,
        deadline: _Deadline,
    ) -> tuple[np.ndarray, int, int, BaseException | None]:
        """Receives the blocks ``indices`` of the reservation over ``conn``; returns the mask
        of verified blocks (over the whole reservation), the corrupt count, the bytes received
        and the failure that ended the stream early (if any)."""
        stripe = _Stripe(reservation, indices, expected, target)
        error: BaseException | None = None
        try:
            self._ensure(conn)
            if isinstance(conn.sock, ssl.SSLSocket):  # TLS decrypts in Python's ssl
                self._receive_frames_in_python(conn, lease_id, stripe, deadline)
            else:
                self._receive_frames_natively(conn, lease_id, stripe, deadline)
        except (OSError, EOFError, wire.FrameError, _StreamError, _ProtocolError) as exc:
            error = exc
            conn.drop()  # the stream's position is unknown
        except PeerUnavailableError as exc:
            error = exc
        corrupt = int((stripe.complete & ~stripe.ok).sum())
        if corrupt:
            log.warning(
                "tpusync: pull from %s: %d blocks failed verification; dropped", conn.label, corrupt
            )
        return stripe.ok, corrupt, stripe.nbytes, error

    def _receive_frames_natively(
        self, conn: _Connection, lease_id: int, stripe: _Stripe, deadline: _Deadline
    ) -> None:
        """The stripe's frames through one :class:`_core.FrameReceiver` (the GIL released across
        blocks); the frames it does not expect are handled here, one at a time."""
        with slot_addresses(stripe.target, stripe.slots) as addresses:
            rid = conn.send_get(lease_id, stripe.keys)
            receiver = stripe.receiver(conn, rid, addresses)
            try:
                try:
                    status = conn.receive_frames(receiver, deadline)
                except (EOFError, ConnectionError):
                    if receiver.bytes_read:
                        raise
                    # Closed before the first byte (an idle connection the server had just
                    # timed out): nothing was written anywhere; ask once more, freshly connected.
                    conn.drop()
                    self._ensure(conn)
                    rid = conn.send_get(lease_id, stripe.keys)
                    receiver = stripe.receiver(conn, rid, addresses)
                    status = conn.receive_frames(receiver, deadline)
                while status == _core.FRAMES_HEADER:  # a frame the receiver did not expect
                    j = receiver.index
                    header = wire.decode_header(receiver.header, max_payload=stripe.limit)
                    if self._frame_has_block(header, rid, conn, stripe.keys[j], stripe.size):
                        stripe.receive_block(conn, j, header, deadline)
                    receiver.resume(j + 1)
                    status = conn.receive_frames(receiver, deadline)
                self._check_end(wire.decode_header(receiver.header, max_payload=stripe.limit),
                                rid, conn)  # fmt: skip
            finally:
                stripe.take_results(receiver)
                del receiver  # before the pool's memory may go

    def _receive_frames_in_python(
        self, conn: _Connection, lease_id: int, stripe: _Stripe, deadline: _Deadline
    ) -> None:
        """The stripe's frames one at a time through :meth:`_Connection.recv_into`."""
        header_buf = bytearray(wire.HEADER_SIZE)
        header_view = memoryview(header_buf)
        rid = conn.send_get(lease_id, stripe.keys)
        try:
            conn.recv_into(header_view, deadline)
        except (EOFError, ConnectionError):
            # Closed before the first frame (an idle connection the server had just timed
            # out): nothing was written anywhere; ask once more on a fresh connection.
            conn.drop()
            self._ensure(conn)
            rid = conn.send_get(lease_id, stripe.keys)
            conn.recv_into(header_view, deadline)
        for j, key in enumerate(stripe.keys):
            if j:
                conn.recv_into(header_view, deadline)
            header = wire.decode_header(header_buf, max_payload=stripe.limit)
            if self._frame_has_block(header, rid, conn, key, stripe.size):
                stripe.receive_block(conn, j, header, deadline)
        conn.recv_into(header_view, deadline)
        self._check_end(wire.decode_header(header_buf, max_payload=stripe.limit), rid, conn)

    def _frame_has_block(
        self, header: wire.FrameHeader, rid: int, conn: _Connection, key: bytes, size: int
    ) -> bool:
        """Whether the frame of block ``key`` carries its payload (BLOCK) or not (MISSING);
        raises _StreamError for anything else."""
        self._check_frame(header, rid, conn)
        if header.frame_type == wire.END:
            raise _StreamError("the response ended early")
        if header.key != key:
            raise _StreamError(f"a frame for {header.key.hex()}, expected {key.hex()}")
        if header.frame_type == wire.MISSING:
            return False
        if header.payload_length != size:
            raise _StreamError(f"a block of {header.payload_length} B, expected {size}")
        return True

    def _check_end(self, header: wire.FrameHeader, rid: int, conn: _Connection) -> None:
        self._check_frame(header, rid, conn)
        if header.frame_type != wire.END:
            raise _StreamError(f"a {header.type_name} frame after the last block")

    # --- push -------------------------------------------------------------------------------

    def push(self, keys: Sequence[bytes], source: HostPool) -> list[bool]:
        """Copies ``source``'s blocks under ``keys`` to the server (a store node); returns for
        each key whether the server holds it now (keys it already held count as True; keys
        ``source`` lacks are False). Payloads go from ``source``'s slots (pinned meanwhile)
        straight to the sockets, striped over the connections; the server verifies each block
        against its checksum before it commits it, and commits nothing of a cut connection.

        A connection that breaks once the server has accepted its part of the push (e.g. the
        server dropped it for a damaged frame) makes that part's keys False (logged), not an
        error: the connection is re-made on the next push.

        Raises InvalidArgumentError (another block layout),
        :class:`RemoteOperationUnsupportedError` (the server does not accept blocks), or
        PeerUnavailableError when no connection could carry the request."""
        keys = check_keys(keys)
        self._check_pool(source, "source")
        if not self.writable:
            raise RemoteOperationUnsupportedError(
                f"push: the block server at {self.label} does not accept blocks; push to a "
                "store node (tpusync serve)"
            )
        stored: dict[bytes, bool] = {}
        errors: list[BaseException] = []
        carried = False  # some connection had its put accepted
        with self._lock:
            self._check_open()
            unique = list(dict.fromkeys(keys))
            for i in range(0, len(unique), MAX_KEYS_PER_REQUEST):
                batch = unique[i : i + MAX_KEYS_PER_REQUEST]
                pinned = source.pin(batch)  # no slot is reused while its bytes are sent
                try:
                    wanted = np.flatnonzero(pinned.present)
                    stripes = [wanted[c :: len(self._conns)] for c in range(len(self._conns))]
                    jobs = [
                        self._executor.submit(
                            self._push_stripe,
                            conn,
                            [batch[j] for j in stripe.tolist()],
                            pinned.slots[stripe],
                            pinned.checksums[stripe],
                            source,
                        )
                        for conn, stripe in zip(self._conns, stripes, strict=True)
                        if len(stripe)
                    ]
                    for job in jobs:
                        part, error, accepted = job.result()
                        stored.update(part)
                        carried |= accepted
                        if error is not None:
                            errors.append(error)
                finally:
                    source.unpin(pinned)
        if errors and not carried and not any(stored.values()):
            raise PeerUnavailableError(f"push to {self.label} failed: {errors[0]}") from errors[0]
        for error in errors:
            log.warning("tpusync: push to %s: %s", self.label, error)
        return [stored.get(k, False) for k in keys]

    def _push_stripe(
        self,
        conn: _Connection,
        keys: list[bytes],
        slots: np.ndarray,
        checksums: np.ndarray,
        source: HostPool,
    ) -> tuple[dict[bytes, bool], BaseException | None, bool]:
        """Pushes one stripe over ``conn``: the server's per-key answer, the failure that cut
        it short (then the keys not confirmed count as not stored), and whether the server had
        accepted the put."""
        fingerprint, size = self.fingerprint, self.payload_bytes
        accepted = False
        try:
            self._ensure(conn)
            try:
                rid, answer = conn.send_put(keys, checksums.tolist())
            except (EOFError, ConnectionError):
                conn.drop()  # an idle connection the server had just closed: ask once more
                self._ensure(conn)
                rid, answer = conn.send_put(keys, checksums.tolist())
            accept = _bool_list(answer, "accept", len(keys))
            present = _bool_list(answer, "present", len(keys))
            accepted = True
            assert conn.sock is not None
            source._ensure_populated(slots)  # pages the batch's views will read
            batch = FrameBatch(conn.sock, source)
            try:
                for key, slot, checksum, take in zip(
                    keys, slots.tolist(), checksums.tolist(), accept, strict=True
                ):
                    if take:
                        batch.add(
                            wire.encode_header(wire.BLOCK, rid, key, fingerprint, size, checksum),
                            slot,
                        )
                batch.flush()
            finally:
                batch.release()
            done = _bool_list(conn.finish_put(rid, fingerprint), "stored", len(keys))
        except (OSError, EOFError, _StreamError, _ProtocolError, PeerUnavailableError) as exc:
            conn.drop()  # the stream's position is unknown
            return {}, exc, accepted
        return {k: p or d for k, p, d in zip(keys, present, done, strict=True)}, None, True

    def _check_pool(self, pool: Any, argument: str) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(
                f"{argument}: expected a HostPool, got {type(pool).__name__}"
            )
        if pool.layout.fingerprint != self.fingerprint:
            raise InvalidArgumentError(
                f"{argument}: the HostPool holds another block layout (model "
                f"{pool.layout.model_id!r}, {pool.layout.payload_bytes} B blocks) than the "
                f"server at {self.label} ({self.payload_bytes} B blocks)"
            )

    def _check_frame(self, header: wire.FrameHeader, rid: int, conn: _Connection) -> None:
        if header.request_id != rid:
            raise _StreamError(f"a frame for request {header.request_id}, expected {rid}")
        if header.frame_type == wire.ERROR:
            if header.payload_length > MAX_ERROR_BYTES:
                raise _StreamError(f"an error message of {header.payload_length} B")
            message = bytearray(header.payload_length)
            conn.recv_into(memoryview(message), time.monotonic() + self._timeout)
            raise _StreamError(
                f"the server failed the request: {message.decode('utf-8', 'replace')}"
            )

    def close(self) -> None:
        """Closes every connection (a pull in progress fails)."""
        self._closed = True
        for conn in [*self._conns, self._control]:
            conn.drop()
        self._executor.shutdown(wait=False)

    def __enter__(self) -> BlockClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bool_list(answer: Any, field_name: str, n: int) -> list[bool]:
    """``answer[field_name]``: a list of ``n`` booleans (a _StreamError when malformed)."""
    value = answer.get(field_name) if isinstance(answer, dict) else None
    if not isinstance(value, list) or len(value) != n or not all(type(v) is bool for v in value):
        raise _StreamError(f"malformed put answer: {answer!r:.200}")
    return value


def _check_lease(lease: Any, n: int) -> tuple[int, np.ndarray, np.ndarray, float]:
    """The fields of an acquire answer, checked (PeerUnavailableError when malformed)."""
    try:
        lease_id = lease["lease"]
        present = lease["present"]
        checksums = lease["checksums"]
        ttl = lease["ttl_s"]
        if (
            type(lease_id) is not int
            or not isinstance(present, list)
            or not isinstance(checksums, list)
            or len(present) != n
            or len(checksums) != n
            or not all(type(p) is bool for p in present)
            or not all(type(c) is int and 0 <= c < 2**64 for c in checksums)
            or not isinstance(ttl, int | float)
            or not ttl > 0
        ):
            raise TypeError
    except (KeyError, TypeError):
        raise PeerUnavailableError(f"malformed acquire answer: {lease!r:.200}") from None
    return (
        lease_id,
        np.array(present, dtype=bool),
        np.array(checksums, dtype=np.uint64),
        float(ttl),
    )


# -- the remote tier -------------------------------------------------------------------------


class RemotePool:
    """The read side of the :class:`~tpusync.tiers.LowerTier` interface over a
    :class:`BlockClient`: ``get`` pulls blocks into a HostPool; ``contains``, ``capacity`` and
    ``used`` ask the server.

    The tier is read-only for now: ``put``, ``delete`` and ``keys`` raise
    :class:`RemoteOperationUnsupportedError` (blocks reach a peer by its own saves; the
    registry says who holds what). ``close`` closes the client only when ``owns_client``.
    """

    read_only = True  # a store reads through it and never writes, demotes to or evicts from it

    def __init__(self, client: BlockClient, layout: PoolLayout, *, owns_client: bool = True):
        if not isinstance(client, BlockClient):
            raise InvalidArgumentError(
                f"client: expected a BlockClient, got {type(client).__name__}"
            )
        if not isinstance(layout, PoolLayout) or layout.fingerprint != client.fingerprint:
            raise InvalidArgumentError(
                f"layout: the server at {client.label} serves another block layout than this one"
            )
        self.client = client
        self.layout = layout
        self.stats = TierStats(f"remote:{client.label}")
        self._owns = owns_client

    @property
    def capacity(self) -> int:
        return self.client.stat()["capacity"]

    @property
    def used(self) -> int:
        return self.client.stat()["used"]

    def get(self, keys: Sequence[bytes], target: HostPool) -> None:
        """Loads the blocks under ``keys`` into ``target`` (see :meth:`BlockClient.pull`);
        raises BlocksMissingError with a ``loaded`` mask when any was not loaded."""
        result = self.client.pull_result(keys, target)
        hits = sum(result.loaded)
        self.stats.add(
            hits=hits,
            misses=len(result.loaded) - hits,
            bytes_out=result.bytes_received,
            checksum_failures=result.corrupt,
        )
        if hits < len(result.loaded):
            error = BlocksMissingError(
                f"keys: {len(result.loaded) - hits} of {len(result.loaded)} blocks not served by "
                f"{self.client.label} ({result.corrupt} failed verification"
                + ("" if result.released else ", the lease lapsed")
                + ")",
                loaded=result.loaded,
                corrupt=result.corrupt,
            )
            if result.error is not None:
                raise error from result.error
            raise error

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.client.contains(keys)

    def put(self, keys: Sequence[bytes], source: HostPool) -> int:
        raise RemoteOperationUnsupportedError(
            "put: a RemotePool is read-only; the peer stores blocks from its own saves"
        )

    def delete(self, keys: Sequence[bytes]) -> int:
        raise RemoteOperationUnsupportedError("delete: a RemotePool is read-only")

    def keys(self) -> list[bytes]:
        raise RemoteOperationUnsupportedError(
            "keys: a RemotePool does not list its peer's keys; ask the registry"
        )

    def close(self) -> None:
        if self._owns:
            self.client.close()

    def __enter__(self) -> RemotePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
