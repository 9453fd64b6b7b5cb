"""Admission of TCP peers before they authenticate, for every tpusync server (registry, block
server, store node): one thread accepts connections and runs all their handshakes without
blocking (``selectors``), each under one deadline for the whole handshake (TLS included) and a
frame limit sized for a handshake, within a budget of unauthenticated connections kept apart
from the authenticated ones; only an authenticated connection is handed on (to its own thread).

When the budget is full, a new connection evicts the oldest unauthenticated one: a peer that
trickles bytes or says nothing holds a place for at most the deadline, and a legitimate client,
whose handshake takes a round trip, still gets in while hostile peers keep the budget full.

Refused peers are logged by :class:`RefusalLog`: at most one line per reason every few seconds,
with the count of the lines it held back.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["HANDSHAKE_FRAME_BYTES", "HandshakeLoop", "RefusalLog", "peer_label"]

HANDSHAKE_FRAME_BYTES = 1024  # a handshake frame is ~160 B of JSON: no reason to take more
REFUSAL_LOG_INTERVAL_S = 5.0
ACCEPT_BATCH = 256  # accepts per wake-up, so that pending handshakes are not starved
_LENGTH = struct.Struct(">I")
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# Reasons (a RefusalLog counts and rate-limits by these tags).
DEADLINE = "handshake deadline passed"
BUDGET = "too many unauthenticated connections (the oldest is dropped)"
OVERSIZED = "oversized handshake frame"
TLS_FAILED = "TLS handshake failed"
OUT_OF_FDS = "out of file descriptors"
INTERNAL = "the handshake failed on this side"
LEFT = "left during the handshake"  # counted, never logged: port probes and health checks

Greeting = Callable[[], tuple[Any, bytes]]
"""Makes a new connection's state and the framed bytes the server sends first."""
Answer = Callable[[Any, bytes], tuple[bytes, str | None]]
"""Given the state and the peer's handshake frame (its body): the framed reply to send, and a
refusal reason (None: the peer is authenticated, and is handed on once the reply is sent;
otherwise the connection closes after the reply, at once when the reply is empty)."""
Handover = Callable[[socket.socket, str, bytes], None]
"""Takes an authenticated, blocking socket, the peer's label and the reply still to send (the
one that tells the peer it is in: sent by the new owner, which is then ready to serve); owns
the socket from then on."""


def peer_label(address: Any) -> str:
    """``"host:port"`` of a socket address (``"[v6]:port"``), or its repr."""
    if isinstance(address, tuple) and len(address) >= 2:
        host = str(address[0])
        return f"[{host}]:{address[1]}" if ":" in host else f"{host}:{address[1]}"
    return repr(address)


class RefusalLog:
    """Counts refused peers by reason and logs them, at most one line per reason every
    ``interval_s`` (a flood of hostile peers must not flood the log); a line says how many
    refusals of its reason were held back since the one before."""

    def __init__(
        self,
        logger: logging.Logger,
        label: Callable[[], str],
        interval_s: float = REFUSAL_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._label = label
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._last: dict[str, float] = {}
        self._held: collections.Counter[str] = collections.Counter()

    def refuse(self, peer: str, reason: str, detail: str = "", *, quiet: bool = False) -> None:
        """Counts one refusal of ``peer`` for ``reason``; logs it unless one of this reason was
        logged less than ``interval_s`` ago (or ``quiet``)."""
        now = self._clock()
        with self._lock:
            self._counts[reason] += 1
            if quiet:
                return
            last = self._last.get(reason)
            if last is not None and now - last < self._interval:
                self._held[reason] += 1
                return
            self._last[reason] = now
            held = self._held.pop(reason, 0)
        more = f" (+{held} more refused for this reason since the last such line)" if held else ""
        self._log.warning(
            "%s: refused %s: %s%s%s", self._label(), peer, reason, f": {detail}" if detail else "",
            more,
        )  # fmt: skip

    def counts(self) -> dict[str, int]:
        """Refusals so far, by reason."""
        with self._lock:
            return dict(self._counts)


class _Pending:
    """One connection that has not authenticated yet."""

    __slots__ = ("deadline", "inbox", "outbox", "peer", "phase", "sock", "state")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.state: Any = None
        self.inbox = bytearray()
        self.outbox = b""
        self.phase = "tls"  # tls -> greet -> read -> handed over, or close (a refusal sent)


class HandshakeLoop:
    """Accepts on ``listener`` and runs every connection's handshake on one thread (see the
    module docstring). ``greet`` and ``answer`` are the protocol (see :data:`Greeting`,
    :data:`Answer`); ``handover`` takes each authenticated socket.

    The loop never blocks on a peer: every socket is non-blocking, a pending connection holds
    at most one handshake frame (``HANDSHAKE_FRAME_BYTES``), and ``max_pending`` bounds them.
    :meth:`close` stops it and closes every pending connection; the listener is the caller's.
    """

    def __init__(
        self,
        listener: socket.socket,
        *,
        greet: Greeting,
        answer: Answer,
        handover: Handover,
        refusals: RefusalLog,
        timeout_s: float,
        max_pending: int,
        tls: ssl.SSLContext | None = None,
        name: str = "tpusync-handshakes",
    ) -> None:
        self._listener = listener
        self._greet, self._answer, self._handover = greet, answer, handover
        self._refusals = refusals
        self._timeout = timeout_s
        self._max_pending = max_pending
        self._tls = tls
        self._pending: collections.OrderedDict[_Pending, None] = collections.OrderedDict()
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        listener.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def pending(self) -> int:
        """Connections authenticating now (a racy snapshot, for tests and stats)."""
        return len(self._pending)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stops the loop (waits for it, briefly) and closes every pending connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self._shut()

    # -- the loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                events = self._selector.select(self._wait())
                accept = False
                for key, mask in events:
                    if key.data == "accept":
                        accept = True  # after the pending ones: an answer before an eviction
                    elif key.data == "wake":
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                    else:
                        self._step(key.data, mask)
                if accept and not self._closed:
                    self._accept()
                self._expire()
        except Exception:  # the loop must not die silently: the server would stop admitting
            logging.getLogger(__name__).exception("handshake loop failed")
            raise

    def _wait(self) -> float | None:
        if not self._pending:
            return None
        oldest = next(iter(self._pending))
        return max(0.0, oldest.deadline - time.monotonic())

    def _shut(self) -> None:
        for pending in list(self._pending):
            self._drop(pending)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(self._listener)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _OUT_OF_FDS:
                    self._refusals.refuse("(not accepted)", OUT_OF_FDS, str(exc))
                    if self._pending:
                        self._drop(next(iter(self._pending)))  # gives one back
                    else:
                        time.sleep(0.05)  # the listener stays readable: do not spin
                    return
                continue  # e.g. ECONNABORTED: the next one
            self._admit(sock, peer_label(address))

    def _admit(self, sock: socket.socket, peer: str) -> None:
        while len(self._pending) >= self._max_pending:
            oldest = next(iter(self._pending))
            self._refusals.refuse(oldest.peer, BUDGET, f"{self._max_pending} are authenticating")
            self._drop(oldest)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pending = _Pending(sock, peer, time.monotonic() + self._timeout)
            if self._tls is not None:
                pending.sock = self._tls.wrap_socket(
                    sock, server_side=True, do_handshake_on_connect=False
                )
        except (OSError, ValueError):
            sock.close()
            return
        self._pending[pending] = None
        self._selector.register(pending.sock, selectors.EVENT_READ, pending)
        if self._tls is None:
            self._begin(pending)
        else:
            self._step(pending, selectors.EVENT_READ)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            self._refusals.refuse(oldest.peer, DEADLINE, f"{self._timeout:g} s")
            self._drop(oldest)

    def _drop(self, pending: _Pending) -> None:
        self._pending.pop(pending, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(pending.sock)
        pending.sock.close()

    def _watch(self, pending: _Pending, events: int) -> None:
        self._selector.modify(pending.sock, events, pending)

    # -- one connection's steps -------------------------------------------------------------

    def _step(self, pending: _Pending, mask: int) -> None:
        """Moves ``pending`` on as far as its socket allows."""
        try:
            if pending.phase == "tls":
                if not self._tls_step(pending):
                    return
                self._begin(pending)
            elif pending.phase == "read":
                self._read(pending)
            else:  # "greet", "close": the outbox is being sent
                self._flush(pending)
        except (ssl.SSLError, OSError) as exc:
            if pending in self._pending:
                tls = pending.phase == "tls" and isinstance(exc, ssl.SSLError)
                self._refusals.refuse(pending.peer, TLS_FAILED if tls else LEFT, str(exc),
                                      quiet=not tls)  # fmt: skip
                self._drop(pending)
        except Exception as exc:  # a fault of ours must not stop admitting everyone else
            if pending in self._pending:
                self._refusals.refuse(pending.peer, INTERNAL, repr(exc))
                self._drop(pending)

    def _tls_step(self, pending: _Pending) -> bool:
        """Runs the TLS handshake on; True once it is done."""
        assert isinstance(pending.sock, ssl.SSLSocket)
        try:
            pending.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._watch(pending, selectors.EVENT_READ)
            return False
        except ssl.SSLWantWriteError:
            self._watch(pending, selectors.EVENT_WRITE)
            return False
        return True

    def _begin(self, pending: _Pending) -> None:
        pending.state, pending.outbox = self._greet()
        pending.phase = "greet"
        self._flush(pending)

    def _read(self, pending: _Pending) -> None:
        """Reads the handshake frame, never a byte past it (what follows is the served
        protocol's), and answers it once whole."""
        inbox = pending.inbox
        while True:
            need = _LENGTH.size if len(inbox) < _LENGTH.size else self._frame_size(pending)
            if need is None:
                return
            if len(inbox) == need:
                break
            try:
                data = pending.sock.recv(need - len(inbox))
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            except ssl.SSLWantWriteError:
                self._watch(pending, selectors.EVENT_WRITE)
                return
            if not data:
                self._refusals.refuse(pending.peer, LEFT, quiet=True)
                self._drop(pending)
                return
            inbox += data
        reply, refusal = self._answer(pending.state, bytes(inbox[_LENGTH.size :]))
        if refusal is None:
            self._pending.pop(pending, None)
            self._selector.unregister(pending.sock)
            pending.sock.setblocking(True)
            self._handover(pending.sock, pending.peer, reply)
            return
        self._refusals.refuse(pending.peer, refusal)
        if not reply:
            self._drop(pending)
            return
        pending.phase = "close"
        pending.outbox = reply
        self._flush(pending)

    def _frame_size(self, pending: _Pending) -> int | None:
        """The whole frame's size (length prefix included); None (the peer dropped) when it
        announces more than a handshake needs."""
        (length,) = _LENGTH.unpack_from(pending.inbox)
        if length > HANDSHAKE_FRAME_BYTES:
            self._refusals.refuse(pending.peer, OVERSIZED, f"{length} B announced")
            self._drop(pending)
            return None
        return _LENGTH.size + length

    def _flush(self, pending: _Pending) -> None:
        """Sends what is left of the outbox; then the phase's next step."""
        while pending.outbox:
            try:
                sent = pending.sock.send(pending.outbox)
            except (BlockingIOError, ssl.SSLWantWriteError):
                self._watch(pending, selectors.EVENT_WRITE)
                return
            except ssl.SSLWantReadError:
                self._watch(pending, selectors.EVENT_READ)
                return
            pending.outbox = pending.outbox[sent:]
        if pending.phase == "greet":
            pending.phase = "read"
            self._watch(pending, selectors.EVENT_READ)
            if isinstance(pending.sock, ssl.SSLSocket) and pending.sock.pending():
                self._read(pending)  # bytes already decrypted: the selector will not say so
        elif pending.phase == "close":
            self._drop(pending)
