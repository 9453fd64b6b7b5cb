"""Admission of TCP peers before they authenticate, for every tpusync server (registry, block
server, store node): one thread accepts connections and runs all their handshakes without
blocking (``selectors``), each under one deadline for the whole handshake (TLS included) and a
frame limit sized for a handshake, within a budget of unauthenticated connections kept apart
from the authenticated ones; only an authenticated connection is handed on (to its own thread).

When the budget is full, a new connection evicts the oldest unauthenticated one: a peer that
trickles bytes or says nothing holds a place for at most the deadline, and a legitimate client,
whose handshake takes a round trip, still gets in while hostile peers keep the budget full.

No peer can stop the loop: every step of a connection (accepting it, TLS, sending, reading,
handing it over) runs under one guard, and whatever a peer causes there (a reset, a half-close,
garbage) costs that connection only. The loop runs under a
:class:`~tpusync._src.cluster.supervisor.SupervisedLoop`: an exception that still escapes (a bug of
ours) restarts it with its pending connections dropped.

A TLS server sees a client that connected without TLS as silence (both sides wait for the other
to speak first): a peer that has sent nothing ``tls_hint_s`` after it was accepted is sent
``tls_hint`` in the clear (a frame a tpusync client reads as "this server speaks TLS") and
closed, so that such a client fails at once with a message saying what to configure, instead of
at its timeout. A TLS client reaches this point within milliseconds of connecting.

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

from tpusync._src.cluster.supervisor import SupervisedLoop

__all__ = ["HANDSHAKE_FRAME_BYTES", "HandshakeLoop", "RefusalLog", "peer_label"]

HANDSHAKE_FRAME_BYTES = 1024  # a handshake frame is ~160 B of JSON: no reason to take more
REFUSAL_LOG_INTERVAL_S = 5.0
ACCEPT_BATCH = 256  # accepts per wake-up, so that pending handshakes are not starved
TLS_HINT_S = 1.0  # silence after which a TLS server's peer is told, in the clear, to use TLS
_LENGTH = struct.Struct(">I")
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)

# Reasons (a RefusalLog counts and rate-limits by these tags).
DEADLINE = "handshake deadline passed"
BUDGET = "too many unauthenticated connections (the oldest is dropped)"
OVERSIZED = "oversized handshake frame"
TLS_FAILED = "TLS handshake failed"
NO_TLS = "sent nothing to this TLS server (a client without TLS?)"
TLS_CLIENT = "a TLS client (this server does not serve TLS)"
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

    __slots__ = ("deadline", "hint_at", "inbox", "outbox", "peer", "phase", "sock", "state")

    def __init__(self, sock: socket.socket, peer: str, deadline: float, phase: str) -> None:
        self.sock = sock
        self.peer = peer
        self.deadline = deadline
        self.hint_at = deadline  # (TLS) when a silent peer is told to use TLS
        self.state: Any = None
        self.inbox = bytearray()
        self.outbox = b""
        # [sniff -> tls ->] new -> greet -> read -> handing -> handed (the server owns it);
        # or close (a refusal being sent, then dropped)
        self.phase = phase


class HandshakeLoop:
    """Accepts on ``listener`` and runs every connection's handshake on one thread (see the
    module docstring). ``greet`` and ``answer`` are the protocol (see :data:`Greeting`,
    :data:`Answer`); ``handover`` takes each authenticated socket.

    The loop never blocks on a peer: every socket is non-blocking, a pending connection holds
    at most one handshake frame (``HANDSHAKE_FRAME_BYTES``), and ``max_pending`` bounds them.
    It is restarted when it dies of a bug (and ``on_failure`` is called if it keeps dying:
    :class:`~tpusync._src.cluster.supervisor.SupervisedLoop`). :meth:`close` stops it and closes
    every pending connection; the listener is the caller's.
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
        tls_hint: bytes | None = None,
        tls_hint_s: float = TLS_HINT_S,
        on_failure: Callable[[BaseException], None] | None = None,
        name: str = "tpusync-handshakes",
    ) -> None:
        self._listener = listener
        self._greet, self._answer, self._handover = greet, answer, handover
        self._refusals = refusals
        self._timeout = timeout_s
        self._max_pending = max_pending
        self._tls = tls
        self._tls_hint = tls_hint if tls is not None else None
        self._tls_hint_s = min(tls_hint_s, timeout_s / 2)
        self._pending: collections.OrderedDict[_Pending, None] = collections.OrderedDict()
        # TLS connections that have sent nothing yet, oldest first (their hint times, in order)
        self._silent: collections.OrderedDict[_Pending, None] = collections.OrderedDict()
        self._closed = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        listener.setblocking(False)
        self._selector = self._new_selector()
        self._loop = SupervisedLoop(self._run, name=name, reset=self._reset, on_failure=on_failure)

    @property
    def pending(self) -> int:
        """Connections authenticating now (a racy snapshot, for tests and stats)."""
        return len(self._pending)

    @property
    def loop(self) -> SupervisedLoop:
        """The loop's thread and its restarts (for health reports)."""
        return self._loop

    def start(self) -> None:
        self._loop.start()

    def close(self) -> None:
        """Stops the loop (waits for it, briefly) and closes every pending connection."""
        self._closed = True
        self._loop.stop()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._loop.join(timeout=5)
        if not self._loop.alive:
            self._shut()

    # -- the loop ---------------------------------------------------------------------------

    def _new_selector(self) -> selectors.BaseSelector:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ, "accept")
        selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        return selector

    def _run(self) -> None:
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

    def _reset(self) -> None:
        """Before a restart: drops every pending connection (its state may be what broke) and
        starts from a fresh selector."""
        for pending in list(self._pending):
            self._drop(pending)
        with contextlib.suppress(OSError, ValueError):
            self._selector.close()
        self._selector = self._new_selector()

    def _wait(self) -> float | None:
        due = [p.deadline for p in self._first(self._pending)]
        due += [p.hint_at for p in self._first(self._silent)]
        return max(0.0, min(due) - time.monotonic()) if due else None

    @staticmethod
    def _first(pending: collections.OrderedDict[_Pending, None]) -> list[_Pending]:
        return [next(iter(pending))] if pending else []

    def _shut(self) -> None:
        for pending in list(self._pending):
            self._drop(pending)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(self._listener)
        with contextlib.suppress(OSError, ValueError):
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
        now = time.monotonic()
        pending = _Pending(sock, peer, now + self._timeout, "new" if self._tls is None else "sniff")
        self._pending[pending] = None
        if self._tls is not None:
            pending.hint_at = now + self._tls_hint_s
            self._silent[pending] = None
        try:  # a peer may have reset already: its socket fails here, and only it is dropped
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._selector.register(sock, selectors.EVENT_READ, pending)
        except (OSError, ValueError) as exc:
            self._refusals.refuse(peer, LEFT, str(exc), quiet=True)
            self._drop(pending)
            return
        self._step(pending, selectors.EVENT_READ)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._silent:
            oldest = next(iter(self._silent))
            if oldest.hint_at > now:
                break
            self._silent.pop(oldest)
            self._guarded(oldest, self._hint)
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            self._refusals.refuse(oldest.peer, DEADLINE, f"{self._timeout:g} s")
            self._drop(oldest)

    def _drop(self, pending: _Pending) -> None:
        """Forgets ``pending`` and closes its socket (never one handed over)."""
        self._pending.pop(pending, None)
        self._silent.pop(pending, None)
        if pending.phase == "handed":
            return
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(pending.sock)
        with contextlib.suppress(OSError):
            pending.sock.close()

    def _watch(self, pending: _Pending, events: int) -> None:
        self._selector.modify(pending.sock, events, pending)

    # -- one connection's steps -------------------------------------------------------------

    def _step(self, pending: _Pending, mask: int) -> None:
        """Moves ``pending`` on as far as its socket allows (whichever way it became ready)."""
        self._guarded(pending, self._advance)

    def _guarded(self, pending: _Pending, step: Callable[[_Pending], None]) -> None:
        """Runs one of ``pending``'s steps: whatever it raises drops that connection only."""
        try:
            step(pending)
        except (ssl.SSLError, OSError, EOFError) as exc:  # the peer's doing: a reset, a bad TLS
            tls = pending.phase == "tls" and isinstance(exc, ssl.SSLError)
            self._refusals.refuse(pending.peer, TLS_FAILED if tls else LEFT, str(exc),
                                  quiet=not tls)  # fmt: skip
            self._drop(pending)
        except Exception as exc:  # a fault of ours must not stop admitting everyone else
            self._refusals.refuse(pending.peer, INTERNAL, repr(exc))
            self._drop(pending)

    def _advance(self, pending: _Pending) -> None:
        if pending.phase == "sniff" and not self._sniff(pending):
            return
        if pending.phase == "tls":
            if not self._tls_step(pending):
                return
            pending.phase = "new"
        if pending.phase == "new":
            self._begin(pending)
        elif pending.phase == "read":
            self._read(pending)
        elif pending.phase in ("greet", "close"):  # the outbox is being sent
            self._flush(pending)

    def _sniff(self, pending: _Pending) -> bool:
        """(TLS) Waits for the peer's first bytes, then wraps its socket; True once wrapped."""
        try:
            first = pending.sock.recv(1, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            return False
        if not first:
            self._refusals.refuse(pending.peer, LEFT, quiet=True)
            self._drop(pending)
            return False
        assert self._tls is not None
        self._silent.pop(pending, None)
        self._selector.unregister(pending.sock)
        # wrap_socket takes the file descriptor over: the raw socket object is closed by it
        pending.sock = self._tls.wrap_socket(
            pending.sock, server_side=True, do_handshake_on_connect=False
        )
        pending.phase = "tls"
        self._selector.register(pending.sock, selectors.EVENT_READ, pending)
        return True

    def _hint(self, pending: _Pending) -> None:
        """(TLS) The peer has said nothing: tells it in the clear that this server speaks TLS
        (a tpusync client without TLS waits for the server to speak first), then closes."""
        if pending.phase != "sniff" or pending not in self._pending:
            return
        self._refusals.refuse(pending.peer, NO_TLS, f"{self._tls_hint_s:g} s")
        if not self._tls_hint:
            self._drop(pending)
            return
        pending.phase = "close"
        pending.outbox = self._tls_hint
        self._flush(pending)

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
            pending.phase = "handing"  # a failure from here on still closes the socket
            self._handover(pending.sock, pending.peer, reply)
            pending.phase = "handed"  # the server owns the socket now
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
            if pending.inbox[:2] == b"\x16\x03" and self._tls is None:  # a TLS ClientHello
                self._refusals.refuse(pending.peer, TLS_CLIENT)
            else:
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
