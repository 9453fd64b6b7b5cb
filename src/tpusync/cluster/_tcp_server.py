"""The TCP server every tpusync server is (registry server, block server, store node): a
listener whose connections authenticate first (on one thread, without blocking:
:mod:`tpusync.cluster._admission`) and are then served on a thread each."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from typing import Any

from tpusync.cluster._admission import HandshakeLoop, RefusalLog, peer_label
from tpusync.cluster._handshake import (
    BUSY,
    REFUSED_AUTH,
    _check_secret,
    _error,
    _frame,
    _ProtocolError,
    check_transport,
    server_greeting,
    server_reply,
)
from tpusync.errors import InvalidArgumentError

__all__ = ["AuthenticatedTcpServer"]

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 128  # connections authenticating at once, by default (see _admission)
LISTEN_BACKLOG = 1024  # the kernel's queue of connections not accepted yet (somaxconn caps it)
REFUSED_FULL = "too many authenticated connections"


def _check_count(value: Any, argument: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{argument}: expected an integer >= 1, got {value!r}")
    return value


class AuthenticatedTcpServer:
    """A TCP listener that serves each connection on its own thread once the peer has passed
    the mutual handshake: the part the registry server, the block server and the store node
    share. Subclasses implement :meth:`_serve_connection` and call :meth:`_start` at the end
    of their ``__init__``.

    Before it authenticates, a connection costs no thread: one thread runs every handshake
    (:class:`~tpusync.cluster._admission.HandshakeLoop`), each under one deadline and a frame
    limit sized for a handshake, at most ``max_handshakes`` at once (beyond that a new
    connection drops the oldest unauthenticated one). Refused peers are logged (address and
    reason, at most one line per reason every few seconds) and counted (:meth:`refusals`).

    Args:
      host, port: where to listen (``port=0``: a free port; see :attr:`address`).
      secret: shared with the clients; at least 16 bytes.
      handshake_timeout_s: the whole handshake (TLS included) must end within this, or the peer
        is dropped.
      max_connections: authenticated connections at most; a client authenticating beyond
        this is told the server is busy.
      max_handshakes: connections authenticating at most (kept apart from the authenticated
        ones: hostile peers that never authenticate cannot lock clients out).
      tls: a server-side ``ssl.SSLContext`` (with its certificate) to encrypt every connection;
        required off loopback unless ``insecure=True``.
    """

    _thread_name = "tpusync-server"
    _label = "server"

    def __init__(
        self,
        host: str,
        port: int,
        *,
        secret: bytes,
        handshake_timeout_s: float,
        max_connections: int,
        max_handshakes: int = MAX_HANDSHAKES,
        tls: ssl.SSLContext | None = None,
        insecure: bool = False,
    ) -> None:
        check_transport(host, tls, insecure, "host")
        self._tls = tls
        self._secret = _check_secret(secret)
        if (
            not isinstance(handshake_timeout_s, int | float)
            or isinstance(handshake_timeout_s, bool)
            or not 0 < handshake_timeout_s <= 3600
        ):
            raise InvalidArgumentError(
                f"handshake_timeout_s: expected (0, 3600] s, got {handshake_timeout_s!r}"
            )
        self._handshake_timeout = float(handshake_timeout_s)
        self._max_connections = _check_count(max_connections, "max_connections")
        self._max_handshakes = _check_count(max_handshakes, "max_handshakes")
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self.rejected = 0  # peers that failed authentication
        self._refusals = RefusalLog(
            logging.getLogger(type(self).__module__), lambda: f"{self._label} {self.address}"
        )
        self._handshakes: HandshakeLoop | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
        bound = self._sock.getsockname()
        self._host, self._port = bound[0], bound[1]

    def _start(self) -> None:
        self._handshakes = HandshakeLoop(
            self._sock,
            greet=server_greeting,
            answer=self._answer,
            handover=self._handover,
            refusals=self._refusals,
            timeout_s=self._handshake_timeout,
            max_pending=self._max_handshakes,
            tls=self._tls,
            name=f"{self._thread_name}:{self._port}",
        )
        self._handshakes.start()

    @property
    def address(self) -> str:
        """Where clients connect: ``"host:port"``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    def refusals(self) -> dict[str, int]:
        """Peers refused so far, by reason (before authentication: deadline passed, budget
        full, oversized frame, wrong secret, ...; after it: a damaged frame, ...)."""
        return self._refusals.counts()

    def _misbehaved(self, conn: socket.socket, reason: str, detail: str = "") -> None:
        """Logs (rate-limited) and counts an authenticated peer that broke the protocol."""
        try:
            peer = peer_label(conn.getpeername())
        except OSError:
            peer = "(a closed connection)"
        self._refusals.refuse(peer, reason, detail)

    def _answer(self, nonce_s: bytes, frame: bytes) -> tuple[bytes, str | None]:
        """The handshake loop's answer to a client's handshake frame (on its thread)."""
        reply, refusal = server_reply(self._secret, nonce_s, frame)
        if refusal == REFUSED_AUTH:
            with self._lock:
                self.rejected += 1
        elif refusal is None:
            with self._lock:
                full = len(self._conns) >= self._max_connections
            if full:
                busy = f"{self._max_connections} connections are open; try again later"
                return _frame(_error(None, BUSY, busy)), REFUSED_FULL
        return reply, refusal

    def _handover(self, conn: socket.socket, peer: str, reply: bytes) -> None:
        """Serves an authenticated connection on a thread of its own, which first sends the
        handshake's last ``reply`` (so the thread exists once the client is in). Called by the
        handshake loop, the only thread that adds connections: the budget check in
        :meth:`_answer` holds."""
        with self._lock:
            if self._closed:
                conn.close()
                return
            thread = threading.Thread(
                target=self._serve,
                args=(conn, reply),
                name=f"{self._thread_name}-conn",
                daemon=True,
            )
            self._conns[conn] = thread
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: refuse this one, keep the others
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()
            self._refusals.refuse(peer, "no thread to serve it", str(exc))

    def _serve(self, conn: socket.socket, reply: bytes) -> None:
        try:
            conn.settimeout(self._handshake_timeout)
            conn.sendall(reply)
            self._serve_connection(conn)
        except (OSError, EOFError):
            pass  # the peer went away
        except _ProtocolError as exc:
            self._misbehaved(conn, "broke the protocol", str(exc))
        except Exception:  # never let one connection take anything else down
            log.exception("%s: connection handler failed", type(self).__name__)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
            conn.close()

    def _serve_connection(self, conn: socket.socket) -> None:
        """Serves an authenticated connection until the peer leaves or the server closes."""
        raise NotImplementedError

    def close(self) -> None:
        """Stops accepting, closes every connection and waits (briefly) for their threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._handshakes is not None:
            self._handshakes.close()  # no connection is handed over after this
        self._sock.close()
        with self._lock:
            conns = list(self._conns.items())
        for conn, _ in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in conns:
            thread.join(timeout=5)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
