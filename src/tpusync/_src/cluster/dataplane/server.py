"""The data plane's server: :class:`BlockServer` serves a HostPool's blocks to
:class:`~tpusync.cluster.BlockClient` peers (the protocol:
:mod:`tpusync._src.cluster.dataplane`)."""

from __future__ import annotations

import logging
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpusync._src.cluster._handshake import _error, _recv_json, _send_json
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.frames import FrameBatch, send_buffers, tune_for_peer
from tpusync._src.cluster.dataplane.leases import LeaseTable
from tpusync._src.cluster.dataplane.local_reads import advertised_file
from tpusync._src.cluster.dataplane.protocol import (
    MAX_ERROR_BYTES,
    PROTOCOL,
    VERSION,
    keys_param,
    lease_param,
    ttl_param,
)
from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync._src.cluster.tcp_server import AuthenticatedTcpServer, BlockServerOptions, options_of
from tpusync._src.tiers.dram import HostPool
from tpusync._src.tiers.dram.pool import populate
from tpusync.errors import InvalidArgumentError

__all__ = ["BlockServer", "Served"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """What one connection of a server serves: a pool and the leases taken on it."""

    pool: HostPool
    leases: LeaseTable


class BlockServer(AuthenticatedTcpServer):
    """Serves ``pool``'s blocks to :class:`BlockClient` peers that know ``secret``.

    Listens at once (``port=0``: a free port; see :attr:`address`); a thread per authenticated
    connection (handshakes share one: :mod:`tpusync._src.cluster._admission`).
    :meth:`close` stops it and releases every lease (the pool stays open: it is the caller's).

    Args:
      pool: the HostPool whose committed blocks are served.
      secret, host, port, lease_ttl_s, handshake_timeout_s, io_timeout_s, max_connections,
        max_handshakes, tls, insecure, clock (keywords), or ``options``: see
        :class:`~tpusync._src.cluster.tcp_server.BlockServerOptions` (``secret`` is required).
      before_lease: called with the keys a peer asks to lease, before the lease is taken (a
        store moves blocks up from its lower tiers into ``pool`` there); failures are logged
        and the keys it could not bring are simply absent.
    """

    def __init__(
        self,
        pool: HostPool,
        *,
        before_lease: Callable[[list[bytes]], None] | None = None,
        options: BlockServerOptions | None = None,
        **keywords: Any,
    ) -> None:
        if not isinstance(pool, HostPool):
            raise InvalidArgumentError(f"pool: expected a HostPool, got {type(pool).__name__}")
        self._listen(options_of(BlockServerOptions, options, keywords))
        self.pool = pool
        try:
            self.leases = LeaseTable(
                pool,
                clock=self.options.clock,
                max_lifetime_s=self.options.lease_lifetime_s,
                on_failure=self._lease_failed,
            )
        except BaseException:
            self._sock.close()  # listening already: give the port back
            raise
        self._served = Served(pool, self.leases)
        self._before_lease = before_lease
        self._start()

    def _listen(self, options: BlockServerOptions) -> None:
        """Starts listening with the (checked) ``options``: what every block server shares;
        :meth:`_start` then starts accepting."""
        AuthenticatedTcpServer.__init__(self, options)
        self.options: BlockServerOptions = options
        self.lease_ttl_s = float(options.lease_ttl_s)
        self.server_id = secrets.token_hex(8)
        self._io_timeout = float(options.io_timeout_s)

    _thread_name = "tpusync-block-server"
    _label = "block server"
    _before_lease: Callable[[list[bytes]], None] | None = None

    def _lease_failed(self, exc: BaseException) -> None:
        self._loop_failed("the lease expiry loop", exc)

    def _loops(self) -> dict[str, SupervisedLoop]:
        return {**super()._loops(), "lease expiry": self.leases.loop}

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
            "release": lambda p: served.leases.release(lease_param(p.get("lease"))),
            "contains": lambda p: served.pool.contains(keys_param(p.get("keys"))),
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
            if method == "health":  # before a hello too: a probe names no layout
                return {"id": rid, "result": self.health()}, served
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
        answer = {
            "protocol": PROTOCOL,
            "version": VERSION,
            "server_id": self.server_id,
            "fingerprint": layout.fingerprint.hex(),
            "payload_bytes": layout.payload_bytes,
            "capacity": served.pool.capacity,
            "lease_ttl_s": self.lease_ttl_s,
            "writable": "put" in self._streams(),
        }
        local = advertised_file(served.pool)
        if local is not None:
            answer["local"] = local
        return answer, served

    def _acquire(self, served: Served, params: dict[str, Any]) -> dict[str, Any]:
        keys = keys_param(params.get("keys"))
        ttl = ttl_param(params.get("ttl_s"), self.lease_ttl_s, self.lease_ttl_s)
        hook = self._before_lease
        if hook is not None:
            try:
                hook(keys)
            except Exception as exc:  # the keys it did not bring are absent: misses, not errors
                log.warning("block server: preparing %d keys failed: %r", len(keys), exc)
        lease = served.leases.acquire(keys, ttl)
        self._read(served, [k for k, p in zip(keys, lease.present, strict=True) if p])
        answer = {
            "lease": lease.lease_id,
            "present": lease.present,
            "checksums": lease.checksums,
            "ttl_s": lease.ttl_s,
        }
        if params.get("slots") is True:  # a reader on this host reads them from the pool file
            answer["slots"] = lease.slots
        return answer

    def _read(self, served: Served, keys: list[bytes]) -> None:
        """Told of the keys a peer is about to read (a hook for servers that keep an LRU)."""

    def _renew(self, served: Served, params: dict[str, Any]) -> bool:
        ttl = ttl_param(params.get("ttl_s"), self.lease_ttl_s, self.lease_ttl_s)
        return served.leases.renew(lease_param(params.get("lease")), ttl)

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
            lease = served.leases.lookup(lease_param(params.get("lease")))
            keys = keys_param(params.get("keys"))
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
        # a time cost the server more CPU per byte: docs/decisions/0003). A subclass that
        # overrides _send_block (tests that pace or damage frames) gets it called per block.
        # All of them leave within lease_max_s: a peer that reads a byte now and then holds
        # this get's pins no longer (its connection is closed then).
        hooked = type(self)._send_block is not BlockServer._send_block
        deadline = Deadline.within(
            self.options.lease_lifetime_s,
            option="lease_max_s",
            what=f"a get of {len(keys)} blocks",
            fix="the peer reads too slowly; raise the server's lease_max_s for slower links",
        )
        batch = FrameBatch(conn, pool, deadline)
        try:
            populate(pool, pinned.slots[pinned.present])  # pages the views will read
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
