"""The frames and the handshake every tpusync TCP connection starts with (registry server, block
server, store node, and their clients): 4-byte big-endian length + UTF-8 JSON frames, and the
mutual HMAC-SHA256 challenge-response (see :mod:`tpusync._src.cluster.registry.server`), with the
transport checks (TLS off loopback) and address parsing they share.

The server's side is split in two (:func:`server_greeting`, :func:`server_reply`) so that a
server can run it without blocking (:mod:`tpusync._src.cluster._admission`); the client's side is
:func:`client_handshake`, tried once more (:func:`retry_if_shed`) when the server sheds it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import random
import secrets
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

from tpusync._src.cluster._admission import HANDSHAKE_FRAME_BYTES
from tpusync.errors import AuthenticationError, InvalidArgumentError

__all__ = ["check_transport", "client_handshake", "parse_address"]

PROTOCOL = "tpusync-registry"
VERSION = 1
MAX_FRAME = 16 * 1024 * 1024
RECV_STEP = 1 << 20  # a frame's buffer starts at most this big and doubles as bytes arrive
NONCE_BYTES = 32
MIN_SECRET_BYTES = 16
BUSY = "Busy"  # the error type of a refusal for load: the client may try again
REFUSED_AUTH = "authentication failed"


class _ProtocolError(Exception):
    """The peer broke the wire format (the connection cannot continue)."""


class _TransportMismatch(ConnectionError):
    """One side speaks TLS and the other does not; the message says which, and what to give
    (never retried: a second try fails the same way)."""


class _Shed(ConnectionError):
    """The server dropped or refused the connection during the handshake: it sheds load (too
    many connections authenticating or open at once); worth one more try."""


def retry_if_shed(connect: Callable[[], None]) -> None:
    """Runs ``connect``, and once more after a short random pause when it failed because the
    server shed the connection (an error caused by :class:`_Shed`)."""
    try:
        connect()
    except Exception as exc:
        if not isinstance(exc.__cause__, _Shed):
            raise
        time.sleep(random.uniform(0.005, 0.05))
        connect()


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes from ``sock``. The buffer grows with what arrives (doubling), not with what
    was announced: a peer that announces a large frame and sends little holds little.
    ``deadline`` (monotonic seconds) bounds the whole read, so a peer that trickles a byte now
    and then cannot stretch it (TimeoutError); None: the socket's timeout per read."""
    buf = bytearray(min(n, RECV_STEP))
    got = 0
    while got < n:
        if deadline is not None:
            _time_left(sock, deadline)
        if got == len(buf):
            buf.extend(bytes(min(len(buf), n - len(buf))))
        with memoryview(buf) as view:
            r = sock.recv_into(view[got:], len(buf) - got)
        if r == 0:
            raise EOFError("connection closed by peer")
        got += r
    return bytes(buf)


def _time_left(sock: socket.socket, deadline: float) -> None:
    """Sets ``sock``'s timeout to what is left before ``deadline``; TimeoutError when none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline passed")
    sock.settimeout(left)


def _recv_frame(
    sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None
) -> bytes:
    (length,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if length > limit:
        raise _ProtocolError(f"a frame of {length} bytes exceeds the limit of {limit}")
    return _recv_exact(sock, length, deadline)


def _frame(obj: Any) -> bytes:
    """``obj`` as one JSON frame (length prefix included)."""
    payload = json.dumps(obj, separators=(",", ":")).encode()
    if len(payload) > MAX_FRAME:
        raise _ProtocolError(f"a frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME}")
    return struct.pack(">I", len(payload)) + payload


def _send_frame(sock: socket.socket, payload: bytes) -> None:
    if len(payload) > MAX_FRAME:
        raise _ProtocolError(f"a frame of {len(payload)} bytes exceeds the limit of {MAX_FRAME}")
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def _send_json(sock: socket.socket, obj: Any) -> None:
    sock.sendall(_frame(obj))


def _parse_json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _ProtocolError(f"a frame is not JSON: {exc}") from None
    except RecursionError:  # e.g. a thousand nested arrays: the peer's garbage, not our fault
        raise _ProtocolError("a frame nests its JSON too deeply") from None


def _recv_json(sock: socket.socket, limit: int = MAX_FRAME, deadline: float | None = None) -> Any:
    return _parse_json(_recv_frame(sock, limit, deadline))


def _mac(secret: bytes, role: bytes, nonce_s: bytes, nonce_c: bytes) -> bytes:
    return hmac.new(secret, role + nonce_s + nonce_c, hashlib.sha256).digest()


def _hex_nonce(value: Any) -> bytes | None:
    try:
        raw = bytes.fromhex(value)
    except (TypeError, ValueError):
        return None
    return raw if len(raw) == NONCE_BYTES else None


def _check_secret(secret: bytes) -> bytes:
    if type(secret) is not bytes or len(secret) < MIN_SECRET_BYTES:
        raise InvalidArgumentError(
            f"secret: expected bytes of at least {MIN_SECRET_BYTES} (e.g. "
            f"secrets.token_bytes(32), shared by server and clients), got "
            f"{type(secret).__name__}" + (f" of {len(secret)}" if isinstance(secret, bytes) else "")
        )
    return secret


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) as a (host, port) pair."""
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgumentError(f"address: expected 'host:port', got {address!r}")
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"address: expected 'host:port', got {address!r}")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) stays on this machine."""
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_transport(host: str, tls: ssl.SSLContext | None, insecure: bool, argument: str) -> None:
    """Off loopback, traffic is encrypted unless the caller says otherwise: a checksum does not
    stop a forged or altered block, and the handshake proves the peers but hides nothing."""
    if tls is not None and not isinstance(tls, ssl.SSLContext):
        raise InvalidArgumentError(f"tls: expected an ssl.SSLContext, got {type(tls).__name__}")
    if tls is None and not insecure and not is_loopback(host):
        raise InvalidArgumentError(
            f"{argument}: {host!r} is not a loopback address, and traffic off loopback is "
            "encrypted by default: pass tls=ssl.SSLContext(...) (server side: with its "
            "certificate; client side: trusting it), or insecure=True to send it in the clear"
        )


def tls_required_frame() -> bytes:
    """What a TLS server sends, in the clear, to a peer that connected without TLS (it says
    nothing, waiting for the server's hello): a hello without a nonce that says so."""
    return _frame({"hello": PROTOCOL, "version": VERSION, "tls": "required"})


def tls_mismatch(peer: str, exc: ssl.SSLError) -> _TransportMismatch | None:
    """The clear error for a TLS client whose handshake failed because ``peer`` answered in
    the clear (a server without TLS); None for any other TLS failure."""
    if exc.reason not in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "UNKNOWN_PROTOCOL",
                          "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST"):  # fmt: skip
        return None
    return _TransportMismatch(
        f"tls: {peer} does not serve TLS (it answered in the clear): connect without tls= (no "
        "--tls-ca), or start the server with a certificate (tpusync serve --tls-cert C "
        "--tls-key K)"
    )


def server_greeting() -> tuple[bytes, bytes]:
    """The server's nonce and its first frame (the hello that carries it)."""
    nonce_s = secrets.token_bytes(NONCE_BYTES)
    return nonce_s, _frame({"hello": PROTOCOL, "version": VERSION, "nonce": nonce_s.hex()})


def server_reply(secret: bytes, nonce_s: bytes, answer: bytes) -> tuple[bytes, str | None]:
    """The server's framed reply to the client's handshake frame ``answer`` (its body), and
    why the client is refused (None: it proved ``secret``; an empty reply: close at once)."""
    try:
        message = _parse_json(answer)
    except _ProtocolError:
        return b"", "not a handshake"
    nonce_c = _hex_nonce(message.get("nonce")) if isinstance(message, dict) else None
    mac = message.get("mac") if isinstance(message, dict) else None
    try:
        mac_bytes = bytes.fromhex(mac) if isinstance(mac, str) else b""
    except ValueError:
        mac_bytes = b""
    if nonce_c is None or not hmac.compare_digest(
        mac_bytes, _mac(secret, b"client", nonce_s, nonce_c)
    ):
        return _frame(_error(None, "AuthenticationError", "authentication failed")), REFUSED_AUTH
    return _frame({"mac": _mac(secret, b"server", nonce_s, nonce_c).hex()}), None


def client_handshake(
    sock: socket.socket,
    secret: bytes,
    peer: str,
    on_hello: Callable[[], None] | None = None,
    deadline: float | None = None,
) -> None:
    """The client's side: proves ``secret`` and checks that the server knows it too. ``peer``
    names the server in errors ("the registry server at host:port"); ``on_hello`` is called
    once the server's hello is in (a health probe tells the steps apart). Raises
    AuthenticationError, :class:`_Shed` (a ConnectionError: the server refused or dropped the
    connection during the handshake, shedding load), :class:`_TransportMismatch` (the server
    speaks TLS and this socket does not), or _ProtocolError / OSError / EOFError for a peer
    that is not a tpusync server. ``deadline`` (monotonic) bounds the whole handshake
    (TimeoutError)."""
    hello = _recv_json(sock, HANDSHAKE_FRAME_BYTES, deadline)
    if not isinstance(hello, dict) or hello.get("hello") != PROTOCOL:
        raise _ProtocolError(f"not a tpusync server: {hello!r:.200}")
    if hello.get("tls") == "required" and not isinstance(sock, ssl.SSLSocket):
        raise _TransportMismatch(
            f"tls: {peer} serves TLS only, and this client connected without it: pass "
            "tls=ssl.create_default_context(cafile=CA), CA being the PEM certificate (or its "
            "CA's) that the server was started with (on the command line: --tls-ca CA)"
        )
    if on_hello is not None:
        on_hello()
    if hello.get("version") != VERSION:
        raise _ProtocolError(f"wire version {hello.get('version')!r}, expected {VERSION}")
    nonce_s = _hex_nonce(hello.get("nonce"))
    if nonce_s is None:
        raise _ProtocolError("the server's nonce is malformed")
    nonce_c = secrets.token_bytes(NONCE_BYTES)
    if deadline is not None:
        _time_left(sock, deadline)
    _send_json(
        sock, {"nonce": nonce_c.hex(), "mac": _mac(secret, b"client", nonce_s, nonce_c).hex()}
    )
    try:
        answer = _recv_json(sock, HANDSHAKE_FRAME_BYTES, deadline)
    except (EOFError, ConnectionError) as exc:
        # A server that refuses a secret says so first; one that just closes is shedding load
        # (too many connections authenticating at once, or its deadline passed).
        raise _Shed(
            f"{peer} closed the connection during authentication (too busy, or a wrong secret); "
            "try again"
        ) from exc
    error = answer.get("error") if isinstance(answer, dict) else None
    if error is not None:
        kind = error.get("type") if isinstance(error, dict) else None
        if kind == BUSY:
            message = error.get("message") if isinstance(error, dict) else ""
            raise _Shed(f"{peer} refused the connection: {message}")
        raise AuthenticationError(
            f"{peer} rejected this client's secret: pass the secret the server was started with"
        )
    theirs = answer.get("mac") if isinstance(answer, dict) else None
    try:
        ok = isinstance(theirs, str) and hmac.compare_digest(
            bytes.fromhex(theirs), _mac(secret, b"server", nonce_s, nonce_c)
        )
    except ValueError:
        ok = False
    if not ok:
        raise AuthenticationError(
            f"{peer} does not know the shared secret (an impostor, or a server started with "
            "another secret)"
        )


def _error(rid: int | None, kind: str, message: str) -> dict[str, Any]:
    return {"id": rid, "error": {"type": kind, "message": message}}
