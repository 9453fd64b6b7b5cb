"""The TCP server every tpusync server is (registry server, block server, store node): a
listener whose connections authenticate first (on one thread, without blocking:
:mod:`tpusync._src.cluster._admission`) and are then served on a thread each.

Its loops (the handshake loop; a block server's lease expiry) are restarted when they die of a
bug (:mod:`tpusync._src.cluster.supervisor`). One that keeps dying is given up on: the server then
closes its listener (a client is refused at once instead of waiting in a queue nobody reads),
records the failure (:attr:`AuthenticatedTcpServer.failure`, and its ``health`` answer), and
calls the callbacks given to :meth:`AuthenticatedTcpServer.on_failure` (``tpusync serve`` exits
non-zero there)."""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from tpusync._src.cluster._admission import HandshakeLoop, RefusalLog, peer_label
from tpusync._src.cluster._handshake import (
    BUSY,
    REFUSED_AUTH,
    _check_secret,
    _error,
    _frame,
    _ProtocolError,
    check_transport,
    server_greeting,
    server_reply,
    tls_required_frame,
)
from tpusync._src.cluster.supervisor import SupervisedLoop, failure_line
from tpusync.errors import DeadlineExceededError, InvalidArgumentError

__all__ = [
    "AuthenticatedTcpServer",
    "BlockServerOptions",
    "ServerOptions",
    "check_lease_lifetime",
    "options_of",
]

log = logging.getLogger(__name__)

MAX_HANDSHAKES = 128  # connections authenticating at once, by default (see _admission)
LISTEN_BACKLOG = 1024  # the kernel's queue of connections not accepted yet (somaxconn caps it)
REFUSED_FULL = "too many authenticated connections"
DEFAULT_LEASE_MAX_S = 600.0  # a lease's whole life, renewals included (see dataplane.leases)
MAX_LEASE_MAX_S = 7 * 86400.0


def check_seconds(value: Any, argument: str, most: float, meaning: str) -> float:
    """``value`` as seconds in (0, ``most``]; the error names ``argument`` and what the value
    means."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= most:
        raise InvalidArgumentError(
            f"{argument}: expected seconds in (0, {most:g}] {meaning}, got {value!r}"
        )
    return float(value)


def check_lease_lifetime(value: Any, argument: str) -> float:
    """A lease's longest life in seconds (``argument`` names it in the error)."""
    return check_seconds(
        value, argument, MAX_LEASE_MAX_S, "(how long a peer that keeps renewing may hold a lease)"
    )


def _check_count(value: Any, argument: str) -> int:
    if type(value) is not int or value < 1:
        raise InvalidArgumentError(f"{argument}: expected an integer >= 1, got {value!r}")
    return value


@dataclass(frozen=True)
class ServerOptions:
    """What every tpusync server listens with, checked when made (the one place these
    arguments are spelled out; the servers take them as keywords or as ``options=``).

    Args:
      secret: shared with the clients; at least 16 bytes (``secrets.token_bytes(32)``).
      host, port: where to listen (``port=0``: a free port).
      handshake_timeout_s: the whole handshake (TLS included) must end within this, or the peer
        is dropped.
      max_connections: authenticated connections at most; a client authenticating beyond
        this is told the server is busy.
      max_handshakes: connections authenticating at most (kept apart from the authenticated
        ones: hostile peers that never authenticate cannot lock clients out).
      tls: a server-side ``ssl.SSLContext`` (with its certificate) to encrypt every connection;
        required off loopback unless ``insecure=True``.
    """

    secret: bytes
    host: str = "127.0.0.1"
    port: int = 0
    handshake_timeout_s: float = 10.0
    max_connections: int = 256
    max_handshakes: int = MAX_HANDSHAKES
    tls: ssl.SSLContext | None = None
    insecure: bool = False

    def __post_init__(self) -> None:
        check_transport(self.host, self.tls, self.insecure, "host")
        _check_secret(self.secret)
        timeout = self.handshake_timeout_s
        if (
            not isinstance(timeout, int | float)
            or isinstance(timeout, bool)
            or not 0 < timeout <= 3600
        ):
            raise InvalidArgumentError(
                f"handshake_timeout_s: expected (0, 3600] s, got {timeout!r}"
            )
        _check_count(self.max_connections, "max_connections")
        _check_count(self.max_handshakes, "max_handshakes")


@dataclass(frozen=True)
class BlockServerOptions(ServerOptions):
    """:class:`ServerOptions` and what every block server adds.

    Args:
      lease_ttl_s: the longest lease granted (a client may ask for less).
      lease_max_s: the longest a lease lives, renewals included: a peer that keeps renewing
        pins blocks no longer (its renewals past it are refused); and the longest a get's frames
        may take to leave, and a store node's put to arrive (a peer that reads or sends a byte
        now and then is closed then). None: 600 s, or ``lease_ttl_s`` if longer.
      io_timeout_s: a connection idle (or stuck sending) this long is closed.
      clock: the lease table's clock (tests).
    """

    lease_ttl_s: float = 10.0
    lease_max_s: float | None = None
    io_timeout_s: float = 300.0
    clock: Callable[[], float] = field(default=time.monotonic)

    def __post_init__(self) -> None:
        super().__post_init__()
        ttl = self.lease_ttl_s
        if not isinstance(ttl, int | float) or not 0 < ttl <= 3600:
            raise InvalidArgumentError(f"lease_ttl_s: expected (0, 3600] s, got {ttl!r}")
        if self.lease_max_s is not None:
            check_lease_lifetime(self.lease_max_s, "lease_max_s")
            if self.lease_max_s < ttl:
                raise InvalidArgumentError(
                    f"lease_max_s: expected at least lease_ttl_s ({ttl:g} s), got "
                    f"{self.lease_max_s!r}; raise it or lower lease_ttl_s"
                )

    @property
    def lease_lifetime_s(self) -> float:
        """``lease_max_s``, or its default (600 s, or ``lease_ttl_s`` if longer)."""
        if self.lease_max_s is not None:
            return float(self.lease_max_s)
        return max(DEFAULT_LEASE_MAX_S, float(self.lease_ttl_s))


OptionsT = TypeVar("OptionsT", bound=ServerOptions)


def options_of(
    kind: type[OptionsT], options: OptionsT | None, keywords: dict[str, Any]
) -> OptionsT:
    """A server's options: ``options`` as given, or made of the ``keywords`` (not both)."""
    if options is None:
        return kind(**keywords)
    if keywords:
        raise InvalidArgumentError(
            f"options: give options or {', '.join(sorted(keywords))}, not both"
        )
    if not isinstance(options, kind):
        raise InvalidArgumentError(
            f"options: expected a {kind.__name__}, got {type(options).__name__}"
        )
    return options


class AuthenticatedTcpServer:
    """A TCP listener that serves each connection on its own thread once the peer has passed
    the mutual handshake: the part the registry server, the block server and the store node
    share. Subclasses implement :meth:`_serve_connection` and call :meth:`_start` at the end
    of their ``__init__``.

    Before it authenticates, a connection costs no thread: one thread runs every handshake
    (:class:`~tpusync._src.cluster._admission.HandshakeLoop`), each under one deadline and a frame
    limit sized for a handshake, at most ``max_handshakes`` at once (beyond that a new
    connection drops the oldest unauthenticated one). Refused peers are logged (address and
    reason, at most one line per reason every few seconds) and counted (:meth:`refusals`).

    ``options``: see :class:`ServerOptions`.
    """

    _thread_name = "tpusync-server"
    _label = "server"

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self._tls = options.tls
        self._secret = options.secret
        self._handshake_timeout = float(options.handshake_timeout_s)
        self._max_connections = options.max_connections
        self._max_handshakes = options.max_handshakes
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._closed = False
        self.rejected = 0  # peers that failed authentication
        self._refusals = RefusalLog(
            logging.getLogger(type(self).__module__), lambda: f"{self._label} {self.address}"
        )
        self._handshakes: HandshakeLoop | None = None
        self._failure: tuple[str, BaseException] | None = None  # (the loop, why it failed)
        self._failure_callbacks: list[Callable[[str, BaseException], None]] = []
        host = options.host
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server(
            (host, options.port), family=family, backlog=LISTEN_BACKLOG
        )
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
            tls_hint=None if self._tls is None else tls_required_frame(),
            on_failure=lambda exc: self._loop_failed("the handshake loop", exc),
            name=f"{self._thread_name}:{self._port}",
        )
        self._handshakes.start()

    # --- its loops' health ---------------------------------------------------------------------

    def _loops(self) -> dict[str, SupervisedLoop]:
        """The server's loops by name (subclasses add theirs)."""
        return {} if self._handshakes is None else {"handshakes": self._handshakes.loop}

    @property
    def failure(self) -> BaseException | None:
        """The exception of a loop that was given up on (it kept dying), or None."""
        return None if self._failure is None else self._failure[1]

    def on_failure(self, callback: Callable[[str, BaseException], None]) -> None:
        """Calls ``callback(loop, exc)`` once if one of this server's loops is given up on
        (at once if one has been): ``loop`` names it and the server ("the handshake loop of
        the store node at host:port"), ``exc`` is its last exception. Runs on the failed
        loop's thread: it should only signal (e.g. set an event)."""
        with self._lock:
            self._failure_callbacks.append(callback)
            failure = self._failure
        if failure is not None:
            callback(*failure)

    def _loop_failed(self, loop: str, exc: BaseException) -> None:
        """A loop was given up on: stop listening (a client is refused at once rather than
        queued for nobody) and tell whoever asked."""
        where = f"{loop} of the {self._label} at {self.address}"
        with self._lock:
            if self._failure is not None:
                return
            self._failure = (where, exc)
            callbacks = list(self._failure_callbacks)
        log.critical(
            "%s kept dying (%s); the server no longer accepts connections: restart the process",
            where, failure_line(exc),
        )  # fmt: skip
        with contextlib.suppress(OSError):
            self._sock.close()
        for callback in callbacks:
            try:
                callback(where, exc)
            except Exception:  # one callback's fault must not keep the others from hearing
                log.exception("%s: a failure callback failed", self._label)

    def health(self) -> dict[str, Any]:
        """What the ``health`` request answers: ``ok`` (every loop runs and none was given
        up on), the server's kind and address, each loop's state and restarts, the failure
        (one line, or None), the connections open and authenticating."""
        loops = {
            name: {"alive": loop.alive, "restarts": loop.restarts}
            for name, loop in self._loops().items()
        }
        failure = self._failure
        with self._lock:
            connections = len(self._conns)
        return {
            "ok": failure is None and all(loop["alive"] for loop in loops.values()),
            "server": self._label,
            "address": self.address,
            "loops": loops,
            "failure": None if failure is None else f"{failure[0]}: {failure_line(failure[1])}",
            "connections": connections,
            "handshakes": 0 if self._handshakes is None else self._handshakes.pending,
        }

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
        except Exception as exc:  # no thread to be had: refuse this one, keep the others
            with self._lock:
                self._conns.pop(conn, None)
            with contextlib.suppress(OSError):
                conn.close()
            self._refusals.refuse(peer, "no thread to serve it", str(exc))

    def _serve(self, conn: socket.socket, reply: bytes) -> None:
        try:
            conn.settimeout(self._handshake_timeout)
            conn.sendall(reply)
            self._serve_connection(conn)
        except DeadlineExceededError as exc:  # e.g. it took a get's frames too slowly
            self._misbehaved(conn, "missed a deadline", str(exc))
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
        with contextlib.suppress(OSError):
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
