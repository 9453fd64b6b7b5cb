"""One path from a :class:`~tpusync.cluster.BlockClient` to its server: the shared RPC
connection (:mod:`tpusync._src.cluster._rpc`) plus the data plane's hello, its binary requests and
the receive loops that fill slots before a deadline."""

from __future__ import annotations

import math
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

from tpusync._native import core as _core
from tpusync._src.cluster._handshake import _ProtocolError, _recv_json
from tpusync._src.cluster._rpc import RpcConnection
from tpusync._src.cluster.dataplane import wire
from tpusync._src.cluster.dataplane.deadlines import Deadline
from tpusync._src.cluster.dataplane.frames import tune_for_peer
from tpusync._src.cluster.dataplane.protocol import (
    PROTOCOL,
    TLS_HASH_STEP,
    VERSION,
    ConnectionLost,
    StreamError,
)
from tpusync.errors import PeerUnavailableError

__all__ = ["Connection"]


class Connection(RpcConnection):
    """One path to the server: a socket (bound to ``local`` when given), its request ids and
    the server's hello."""

    def __init__(
        self,
        local: tuple[str, int] | None,
        remote: tuple[str, int],
        label: str,
        secret: bytes,
        timeout: float,
        tls: ssl.SSLContext | None = None,
        layout: dict[str, Any] | None = None,
        on_hello: Callable[[Connection], None] | None = None,
    ) -> None:
        super().__init__(
            remote,
            peer=f"the block server at {label}",
            secret=secret,
            timeout=timeout,
            tls=tls,
            local=local,
            unavailable=PeerUnavailableError,
            lost=ConnectionLost,
            refusal_prefix=f"{label}: ",
            probe=True,
        )
        self.label = label
        self._layout = layout
        self._on_hello = on_hello  # checks each (re)connection's server (the same one)
        self.hello: dict[str, Any] = {}

    def _tune(self, sock: socket.socket) -> None:
        tune_for_peer(sock)  # for pushes

    def _greet(self) -> None:
        params: dict[str, Any] = {"protocol": PROTOCOL, "version": VERSION}
        if self._layout is not None:
            params["layout"] = self._layout
        hello = self.call_once("hello", params)
        if not isinstance(hello, dict) or hello.get("protocol") != PROTOCOL:
            raise _ProtocolError(f"not a tpusync block server: {hello!r:.200}")
        self.hello = hello
        if self._on_hello is not None:
            self._on_hello(self)

    def send_get(self, lease_id: int, keys: Sequence[bytes]) -> int:
        rid = self.next_id()
        self.send_request(rid, "get", {"lease": lease_id, "keys": [k.hex() for k in keys]})
        return rid

    def send_put(
        self, keys: Sequence[bytes], checksums: Sequence[int], deadline: Deadline | None = None
    ) -> tuple[int, Any]:
        """Sends a ``put`` request and returns its id and the server's answer (which keys it
        wants), before ``deadline`` (the push's; None: the I/O timeout alone); the blocks
        follow (``frames.FrameBatch``), then :meth:`finish_put`."""
        assert self.sock is not None
        deadline = deadline or Deadline(math.inf)
        rid = self.next_id()
        self.sock.settimeout(self._send_wait(deadline))
        params = {"keys": [k.hex() for k in keys], "checksums": [int(c) for c in checksums]}
        self.send_request(rid, "put", params)
        return rid, self._answer(rid, "put", deadline)

    def _send_wait(self, deadline: Deadline) -> float:
        """The longest one send may wait now: the I/O timeout, or what is left of
        ``deadline``; DeadlineExceededError when nothing is."""
        left = deadline.left()
        if left <= 0:
            raise deadline.missed()
        return min(self._timeout, left)

    def _answer(self, rid: int, method: str, deadline: Deadline | None = None) -> Any:
        """Reads the JSON answer to ``rid`` in the middle of a put's stream, within the I/O
        timeout and ``deadline`` (however the server trickles it)."""
        assert self.sock is not None
        deadline = deadline or Deadline(math.inf)
        wait = self._send_wait(deadline)
        try:
            response = _recv_json(self.sock, deadline=time.monotonic() + wait)
        except TimeoutError as exc:
            if deadline.left() <= 0:
                raise deadline.missed() from exc
            raise TimeoutError(f"{self.label} did not answer the {method} in {wait:g} s") from exc
        finally:
            if self.sock is not None:
                self.sock.settimeout(self._timeout)
        return self.result(response, rid, method, StreamError)

    def finish_put(self, rid: int, fingerprint: bytes, deadline: Deadline | None = None) -> Any:
        """Ends a put's blocks and returns the server's answer (which keys it stored), before
        ``deadline``."""
        assert self.sock is not None
        deadline = deadline or Deadline(math.inf)
        self.sock.settimeout(self._send_wait(deadline))
        self.sock.sendall(wire.encode_header(wire.END, rid, b"", fingerprint))
        return self._answer(rid, "put", deadline)

    def recv_into(
        self,
        view: memoryview,
        deadline: float | Deadline,
        hasher: _core.PieceHasher | None = None,
    ) -> None:
        """Fills ``view`` from the socket before ``deadline`` (monotonic; a :class:`Deadline`
        is read again at every wait, so lease renewals move it on, up to its cap), feeding
        ``hasher`` with the bytes as they land (under TLS 64 KiB at a time: after a failure it
        may lag behind)."""
        assert self.sock is not None
        got, n = 0, view.nbytes
        native = not isinstance(self.sock, ssl.SSLSocket)  # TLS decrypts in Python's ssl
        timeout_set: float | None = None  # what the TLS socket waits at most, as last set
        fed = 0  # TLS: bytes hashed so far
        while got < n:
            at = deadline.at if isinstance(deadline, Deadline) else deadline
            left = at - time.monotonic()
            if left <= 0:
                if isinstance(deadline, Deadline):
                    raise deadline.missed()
                raise TimeoutError(f"{self.label}: the read's deadline passed")
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
                # a record (16 KiB) at a time hashed slower and cost a call each (0003)
                hasher.feed(view[fed:got])
                fed = got

    def receive_frames(self, receiver: _core.FrameReceiver, deadline: Deadline) -> int:
        """Runs ``receiver`` until it is done or stops at a frame it did not expect, within
        ``deadline`` (read again at every wait) and the connection's I/O timeout."""
        while True:
            left = deadline.left()
            if left <= 0:
                raise deadline.missed()
            status = receiver.run(left, self._timeout)
            if status == _core.FRAMES_SILENT:
                raise TimeoutError(f"{self.label} sent nothing for {self._timeout:g} s")
            if status != _core.FRAMES_TIMEOUT:  # else: the deadline's turn (it may have moved)
                return status
