"""A health probe of a tpusync server (what ``tpusync health`` runs): a real connection, TLS
where given, the authenticated handshake and one ``health`` request, all within one deadline.

Each step that can fail says so in one line: nothing listens; the connection is accepted but no
hello comes (the handshake loop is stuck or overloaded); the hello comes but the proof is not
answered (no connection thread was started); the secret is refused; one side speaks TLS and the
other does not; the server answers that one of its loops was given up on.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from tpusync._src.cluster._handshake import (
    _check_secret,
    _ProtocolError,
    _recv_json,
    _send_frame,
    _Shed,
    _TransportMismatch,
    check_transport,
    client_handshake,
    parse_address,
    tls_mismatch,
)
from tpusync.errors import AuthenticationError, InvalidArgumentError

__all__ = ["ServerHealth", "probe_health"]

DEFAULT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ServerHealth:
    """What :func:`probe_health` found.

    Attributes:
      address: the server probed (``host:port``).
      healthy: it completed the handshake and answered that all its loops run.
      reason: one line: what is wrong, or what was checked.
      seconds: how long the probe took.
      report: the server's own ``health`` answer (None when it gave none).
    """

    address: str
    healthy: bool
    reason: str
    seconds: float
    report: dict[str, Any] | None = None


def probe_health(
    address: str,
    *,
    secret: bytes,
    tls: ssl.SSLContext | None = None,
    insecure: bool = False,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> ServerHealth:
    """Probes the tpusync server (store node, block server, registry server, weights
    publisher) at ``address``: connects, authenticates with ``secret`` (TLS with ``tls``, a
    client context trusting the server's certificate) and asks for its health, all within
    ``timeout_s``. Returns a :class:`ServerHealth`; an unhealthy or unreachable server is not
    an exception. Raises :class:`~tpusync.errors.InvalidArgumentError` for a malformed
    argument (an address off loopback without ``tls`` needs ``insecure=True``)."""
    host, port = parse_address(address)
    _check_secret(secret)
    check_transport(host, tls, insecure, "address")
    if (
        not isinstance(timeout_s, int | float)
        or isinstance(timeout_s, bool)
        or not 0 < timeout_s <= 3600
    ):
        raise InvalidArgumentError(f"timeout_s: expected (0, 3600] s, got {timeout_s!r}")
    return _Probe(address, (host, port), secret, tls, float(timeout_s)).run()


class _Probe:
    """One probe: its steps, the socket the deadline's watchdog shuts, the step it cut."""

    def __init__(
        self,
        address: str,
        remote: tuple[str, int],
        secret: bytes,
        tls: ssl.SSLContext | None,
        timeout_s: float,
    ) -> None:
        self.address, self.remote, self.secret, self.tls = address, remote, secret, tls
        self.timeout = timeout_s
        self.start = time.monotonic()
        self.step = "connect"
        self.sock: socket.socket | None = None
        self.expired = threading.Event()
        self.lock = threading.Lock()

    def _expire(self) -> None:
        """The deadline passed: shuts the socket, which ends whatever step waits on it."""
        with self.lock:
            self.expired.set()
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.shutdown(socket.SHUT_RDWR)

    def _set(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            if self.expired.is_set():
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        sock.settimeout(max(0.001, self.start + self.timeout - time.monotonic()))

    def _done(self, healthy: bool, reason: str, report: dict[str, Any] | None = None) -> Any:
        return ServerHealth(self.address, healthy, reason, time.monotonic() - self.start, report)

    def run(self) -> ServerHealth:
        watchdog = threading.Timer(self.timeout, self._expire)
        watchdog.daemon = True
        watchdog.start()
        try:
            return self._run()
        except (OSError, EOFError, _ProtocolError, AuthenticationError) as exc:
            return self._done(False, self._why(exc))
        finally:
            watchdog.cancel()
            if self.sock is not None:
                with contextlib.suppress(OSError):
                    self.sock.close()

    def _run(self) -> ServerHealth:
        sock = socket.create_connection(self.remote, timeout=self.timeout)
        self._set(sock)
        if self.tls is not None:
            self.step = "tls"
            try:
                sock = self.tls.wrap_socket(sock, server_hostname=self.remote[0])
            except ssl.SSLError as exc:
                raise tls_mismatch(f"the server at {self.address}", exc) or exc from None
            self._set(sock)
        self.step = "hello"
        client_handshake(sock, self.secret, f"{self.address}", on_hello=self._hello)
        self.step = "request"
        _send_frame(sock, json.dumps({"id": 1, "method": "health", "params": {}}).encode())
        answer = _recv_json(sock)
        if self.expired.is_set():
            raise TimeoutError
        return self._judge(answer)

    def _hello(self) -> None:
        self.step = "answer"

    def _judge(self, answer: Any) -> ServerHealth:
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict):
            message = str(error.get("message", ""))
            if message.startswith("unknown method"):  # a server that predates the request
                return self._done(True, "authenticated and answered a request (this server "
                                  "does not report its loops)")  # fmt: skip
            return self._done(False, f"the health request failed: {message:.200}")
        report = answer.get("result") if isinstance(answer, dict) else None
        if not isinstance(report, dict) or answer.get("id") != 1:
            return self._done(False, f"not a health answer: {answer!r:.200}")
        found = report.get("loops")
        loops: dict[str, Any] = found if isinstance(found, dict) else {}
        kind = report.get("server", "server")
        if report.get("ok") is True:
            restarts = sum(int(v.get("restarts", 0)) for v in loops.values() if isinstance(v, dict))
            again = f", {restarts} restart(s) so far" if restarts else ""
            return self._done(
                True,
                f"{kind}: authenticated; {len(loops)} loop(s) running{again}; "
                f"{report.get('connections', '?')} connection(s) open",
                report,
            )
        if report.get("failure"):
            return self._done(False, f"{kind}: {report['failure']} (it no longer accepts "
                              "connections: restart it)", report)  # fmt: skip
        stopped = [n for n, v in loops.items() if isinstance(v, dict) and not v.get("alive")]
        return self._done(False, f"{kind}: not running: {', '.join(stopped) or '?'}", report)

    def _why(self, exc: BaseException) -> str:
        """The one line that says which step failed and how."""
        t = f"{self.timeout:g} s"
        timed_out = self.expired.is_set() or isinstance(exc, TimeoutError)
        if isinstance(exc, _TransportMismatch | AuthenticationError):
            return str(exc)
        if self.step == "connect":
            if isinstance(exc, ConnectionRefusedError):
                return "nothing listens there (connection refused)"
            if timed_out:
                return f"no connection within {t} (unreachable, or its listen queue is full)"
            return f"cannot connect: {getattr(exc, 'strerror', None) or exc}"
        if timed_out:
            return {
                "tls": f"no TLS handshake within {t} (does the server serve TLS?)",
                "hello": f"it accepted the connection but sent no hello within {t}: its "
                "handshake loop is stuck or overloaded",
                "answer": f"it sent its hello but did not answer the handshake within {t}: "
                "overloaded, or it cannot start a connection thread",
                "request": f"it authenticated this probe but did not answer a request within {t}",
            }[self.step]
        if isinstance(exc, ssl.SSLError):
            return f"the TLS handshake failed: {exc}"
        if isinstance(exc, _Shed):
            return f"it is shedding load: {exc}"
        if isinstance(exc, _ProtocolError):
            return f"not a tpusync server, or a version this one does not speak: {exc}"
        if isinstance(exc, EOFError | ConnectionError):
            where = {"tls": "during TLS", "hello": "before its hello", "answer": "during the "
                     "handshake", "request": "before answering"}.get(self.step, "")  # fmt: skip
            return f"it closed the connection {where} ({exc or 'end of stream'})"
        return f"{type(exc).__name__}: {exc}"
