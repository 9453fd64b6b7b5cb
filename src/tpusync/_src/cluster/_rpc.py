"""The client side of every tpusync control connection (the registry's and the data plane's):
connect, the mutual handshake, then JSON requests, one answer each matched by its id.

One loop for both clients: :meth:`RpcConnection.call` reconnects once when the server had
closed the connection (e.g. an idle one it timed out) and maps every failure to the client's
own error (``unavailable``); an answer the server refused with ``InvalidArgumentError`` is
raised as that.

``timeout`` is an absolute deadline per request, not per system call: connecting, TLS, the
handshake, the request, its answer and the one reconnection all fit in it. (A deadline per
system call let a peer that trickles a byte now and then, or a reconnect after a timeout,
stretch one request many times over: TPU Sync's issue #888 added such timeouts up to 48 min.)
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from typing import Any

from tpusync._src.cluster._handshake import (
    _ProtocolError,
    _recv_json,
    _send_frame,
    _time_left,
    _TransportMismatch,
    client_handshake,
    retry_if_shed,
    tls_mismatch,
)
from tpusync.errors import AuthenticationError, InvalidArgumentError

__all__ = ["RpcConnection"]


class RpcConnection:
    """One authenticated connection to a tpusync server that carries JSON requests.

    Args:
      remote: the server's (host, port); ``local``: the (host, port) to bind first, or None.
      peer: the server in error messages (``"the registry server at host:port"``).
      secret, timeout, tls: the handshake's secret, each request's deadline (connecting
        included; seconds from its start) and the client-side TLS context (or None).
      unavailable: the error raised when the server cannot be reached or failed a request;
        ``lost``: its subclass for a connection the server closed (one reconnect is worth it);
        ``unknown_method``: its subclass for a method the server does not know (None:
        ``unavailable``).
      refusal_prefix: put before the server's message in an InvalidArgumentError.
      probe: check that an open socket is still open before each call (a non-blocking peek).
    """

    def __init__(
        self,
        remote: tuple[str, int],
        *,
        peer: str,
        secret: bytes,
        timeout: float,
        unavailable: type[Exception],
        lost: type[Exception],
        tls: ssl.SSLContext | None = None,
        local: tuple[str, int] | None = None,
        unknown_method: type[Exception] | None = None,
        refusal_prefix: str = "",
        probe: bool = False,
    ) -> None:
        self.remote, self.local, self.peer = remote, local, peer
        self._secret, self._timeout, self._tls = secret, timeout, tls
        self._unavailable, self._lost = unavailable, lost
        self._unknown_method = unknown_method or unavailable
        self._refusal_prefix = refusal_prefix
        self._probe = probe
        self.sock: socket.socket | None = None
        self._connecting: socket.socket | None = None
        self._closed = False
        # close() and a connect on another thread: the socket a connect makes is published
        # under this lock, after a check that close() has not run (else it would connect
        # behind it and wait out a whole timeout on a peer nobody listens to any more)
        self._state = threading.Lock()
        self._next_id = 0
        # the deadline of the request in progress (monotonic), read by every step of it
        self._deadline: float | None = None

    # --- the connection ---------------------------------------------------------------------

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def ensure(self) -> None:
        """Connects (or re-connects a socket the server closed meanwhile); never after
        :meth:`close`."""
        if self._closed:
            raise self._unavailable(f"the connection to {self.peer} is closed")
        if self.sock is not None and self._probe and not self._alive(self.sock):
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
        """Connects and authenticates (once more when the server shed the first try), all
        within the deadline of the request in progress, else within ``timeout``."""
        with self._deadline_set():
            retry_if_shed(self._connect_once)

    @contextlib.contextmanager
    def _deadline_set(self) -> Any:
        """Starts a request's deadline unless one is running (the outermost call sets it)."""
        if self._deadline is not None:
            yield
            return
        self._deadline = time.monotonic() + self._timeout
        try:
            yield
        finally:
            self._deadline = None

    def _left(self) -> float:
        """Seconds left before the request's deadline (``unavailable`` when none)."""
        left = (self._deadline or 0.0) - time.monotonic()
        if left <= 0:
            raise self._unavailable(
                f"{self.peer} did not answer within {self._timeout:g} s (the request's deadline)"
            ) from TimeoutError("the request's deadline passed")
        return left

    def _connect_once(self) -> None:
        left = self._left()
        try:
            sock = socket.create_connection(self.remote, timeout=left, source_address=self.local)
        except OSError as exc:
            raise self._unavailable(f"cannot connect to {self.peer}: {exc}") from exc
        try:
            self._publish(sock, connected=False)  # close() from another thread reaches it
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            assert self._deadline is not None
            _time_left(sock, self._deadline)  # TLS's handshake waits on the socket's timeout
            if self._tls is not None:
                try:
                    sock = self._tls.wrap_socket(sock, server_hostname=self.remote[0])
                except ssl.SSLError as exc:
                    raise tls_mismatch(self.peer, exc) or exc from None
                self._publish(sock, connected=False)
            self._tune(sock)
            client_handshake(sock, self._secret, self.peer, deadline=self._deadline)
            sock.settimeout(self._timeout)  # the deadline's rest is for this request only
            self._publish(sock, connected=True)
            self._greet()
        except (AuthenticationError, InvalidArgumentError, self._unavailable):
            # e.g. a layout the server refused, or closed meanwhile
            self._connecting = None
            self.drop(sock)
            raise
        except (OSError, EOFError, _ProtocolError) as exc:
            self._connecting = None
            self.drop(sock)
            if isinstance(exc, self._unavailable):
                raise
            if isinstance(exc, _TransportMismatch):  # the message says it all
                raise self._unavailable(str(exc)) from exc
            raise self._unavailable(f"{self.peer} failed the handshake: {exc}") from exc

    def _publish(self, sock: socket.socket, *, connected: bool) -> None:
        """Makes ``sock`` the one :meth:`close` shuts down (mid-handshake, or ``connected``);
        raises ``unavailable`` when the connection was closed meanwhile."""
        with self._state:
            if not self._closed:
                self._connecting = None if connected else sock
                if connected:
                    self.sock = sock
                return
        raise self._unavailable(f"the connection to {self.peer} was closed while connecting")

    def _tune(self, sock: socket.socket) -> None:
        """Sets up a new socket before the handshake (a hook)."""

    def _greet(self) -> None:
        """The first requests after the handshake (a hook: the data plane's hello)."""

    def close(self) -> None:
        """Drops the connection for good: a request on another thread fails at once and
        nothing connects again."""
        with self._state:  # no connect publishes a socket after this
            self._closed = True
        self.drop()

    def drop(self, sock: socket.socket | None = None) -> None:
        pending = self._connecting
        if sock is None and pending is not None:  # a handshake in progress
            with contextlib.suppress(OSError):
                pending.shutdown(socket.SHUT_RDWR)
        sock = sock or self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked on it (close does not)
            with contextlib.suppress(OSError):
                sock.close()
        self.sock = None

    # --- requests ---------------------------------------------------------------------------

    def call(self, method: str, params: dict[str, Any]) -> Any:
        """One request and its result, on a fresh connection once more when the server had
        closed this one (a retried request must be safe to repeat: every control request is)."""
        with self._deadline_set():
            self.ensure()
            try:
                return self.call_once(method, params)
            except self._lost:
                self.ensure()
                return self.call_once(method, params)

    def call_once(self, method: str, params: dict[str, Any]) -> Any:
        """One JSON request and its result on the open connection. Raises ``lost`` (the
        server closed it), ``unavailable`` (dropped: it timed out, broke the protocol or the
        server failed the request) or InvalidArgumentError (the server refused the
        arguments)."""
        sock = self.sock
        if sock is None:
            raise self._unavailable(f"not connected to {self.peer}")
        rid = self.next_id()
        with self._deadline_set():
            deadline = self._deadline
            assert deadline is not None
            try:
                _time_left(sock, deadline)  # the send's timeout: what the request has left
                self.send_request(rid, method, params)
                response = _recv_json(sock, deadline=deadline)
            except TimeoutError as exc:
                self.drop()
                raise self._unavailable(
                    f"{self.peer} did not answer {method} within {self._timeout:g} s"
                ) from exc
            except (OSError, EOFError) as exc:
                self.drop()
                lost = isinstance(exc, EOFError | ConnectionError)
                raise (self._lost if lost else self._unavailable)(
                    f"lost the connection to {self.peer} during {method}: {exc!r}"
                ) from exc
            except _ProtocolError as exc:
                self.drop()
                raise self._unavailable(f"{self.peer} broke the protocol: {exc}") from exc
            finally:
                if self.sock is sock:  # the data plane reads this socket with its own waits
                    with contextlib.suppress(OSError):
                        sock.settimeout(self._timeout)
        if not isinstance(response, dict) or response.get("id") != rid:
            self.drop()
        return self.result(response, rid, method)

    def send_request(self, rid: int, method: str, params: dict[str, Any]) -> None:
        """Sends request ``rid`` (its answer, or the frames that follow it, are the caller's)."""
        assert self.sock is not None
        body = {"id": rid, "method": method, "params": params}
        _send_frame(self.sock, json.dumps(body, separators=(",", ":")).encode())

    def result(
        self, response: Any, rid: int, method: str, failure: type[Exception] | None = None
    ) -> Any:
        """The result of the answer to request ``rid``: InvalidArgumentError when the server
        refused the arguments, ``failure`` (default ``unavailable``) when it answered out of
        turn or failed."""
        failure = failure or self._unavailable
        if not isinstance(response, dict) or response.get("id") != rid:
            raise failure(f"{self.peer} answered out of turn: {response!r:.200}")
        error = response.get("error")
        if error is not None:
            kind = error.get("type") if isinstance(error, dict) else None
            message = error.get("message") if isinstance(error, dict) else str(error)
            if kind == "InvalidArgumentError":
                raise InvalidArgumentError(f"{self._refusal_prefix}{message}")
            if kind == "ProtocolError" and str(message).startswith("unknown method"):
                raise self._unknown_method(f"{self.peer} does not serve {method}: {message}")
            raise failure(f"{self.peer} failed {method}: {message}")
        return response.get("result")
