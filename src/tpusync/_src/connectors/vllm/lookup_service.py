"""The worker's answer to the scheduler's question "how much of this request does the store
hold?", across processes (docs/decisions/0008-vllm-connector-processes.md).

The worker side owns the store and serves lookups on a Unix socket in a directory only its
user can enter; a connecting process of another uid is refused (``SO_PEERCRED``). A lookup
pins the blocks it finds under the request id and a sequence number, so what the scheduler
counts stays loadable until the load or a release consumes the pins. The scheduler waits at
most its deadline: no answer in time is a miss (and a release of that lookup's pins).

Wire format (little-endian), one request then one answer per round trip on a connection:

* request (a lookup): ``u32 body length``, then the body: ``u8 op`` (``L``), ``u64 sequence``,
  ``u16 request-id length`` and the id (UTF-8), ``u32 count`` and that many ``u8 length`` +
  hash bytes.
* answer: ``u32 blocks``, ``u8 asynchronous``.

Releases travel with the step's metadata instead (in order with the loads). Bodies and counts
are bounded (:data:`MAX_BODY_BYTES`, :data:`MAX_HASHES`); a malformed body closes the
connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tpusync._src.cluster.supervisor import SupervisedLoop
from tpusync._src.tiers.files import make_directory
from tpusync.errors import InvalidArgumentError, UnsafeFileError

__all__ = ["MAX_BODY_BYTES", "MAX_HASHES", "LookupClient", "LookupServer"]

log = logging.getLogger("tpusync.connectors.vllm")

MAX_BODY_BYTES = 16 << 20
MAX_HASHES = 1 << 16  # blocks of one request (1M tokens of 16-token blocks)
MAX_CONNECTIONS = 8
ACCEPT_PAUSE_S = 0.05  # after a failed accept (e.g. EMFILE): no busy loop while it lasts
_HEAD = struct.Struct("<BQH")
_ANSWER = struct.Struct("<IB")
_LOOKUP = b"L"[0]

# (request id, sequence, hashes) -> (blocks found and pinned, any of them below DRAM)
Answer = Callable[[str, int, list[bytes]], tuple[int, bool]]


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def encode_request(req_id: str, sequence: int, hashes: list[bytes]) -> bytes:
    rid = req_id.encode()
    parts = [_HEAD.pack(_LOOKUP, sequence, len(rid)), rid, struct.pack("<I", len(hashes))]
    parts.extend(bytes((len(h),)) + h for h in hashes)
    body = b"".join(parts)
    return struct.pack("<I", len(body)) + body


def decode_request(body: bytes) -> tuple[str, int, list[bytes]]:
    """(request id, sequence, hashes); raises ValueError for a malformed body."""
    if len(body) < _HEAD.size:
        raise ValueError("short body")
    op, sequence, rid_len = _HEAD.unpack_from(body)
    at = _HEAD.size + rid_len
    if op != _LOOKUP or at + 4 > len(body):
        raise ValueError("bad op or request id")
    req_id = body[_HEAD.size : at].decode()
    (count,) = struct.unpack_from("<I", body, at)
    at += 4
    if count > MAX_HASHES:
        raise ValueError(f"{count} hashes, more than {MAX_HASHES}")
    hashes: list[bytes] = []
    for _ in range(count):
        if at >= len(body):
            raise ValueError("truncated hash")
        n = body[at]
        if not n or at + 1 + n > len(body):
            raise ValueError("bad hash length")
        hashes.append(body[at + 1 : at + 1 + n])
        at += 1 + n
    if at != len(body):
        raise ValueError("trailing bytes")
    return req_id, sequence, hashes


def _served_by_someone(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class LookupServer:
    """Serves lookups and releases for the worker on ``path`` (its directory is made 0700
    and checked; a stale socket of an earlier worker is replaced) until :meth:`close`."""

    def __init__(self, path: Path, answer: Answer) -> None:
        try:
            make_directory(path.parent)
        except UnsafeFileError as error:
            raise UnsafeFileError(
                f"socket_dir: {error} (give kv_connector_extra_config a socket_dir of this "
                "user's own, or set XDG_RUNTIME_DIR)"
            ) from None
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            info = None
        if info is not None:
            if not stat.S_ISSOCK(info.st_mode):
                raise InvalidArgumentError(
                    f"socket_dir: {path} exists and is not a socket; remove it or choose "
                    "another socket_dir"
                )
            if _served_by_someone(path):
                raise InvalidArgumentError(
                    f"socket_dir: another worker serves lookups on {path} (the same engine_id "
                    "twice?); give each engine its own kv_transfer_config.engine_id"
                )
            path.unlink()  # an earlier worker's, which is gone: this engine's id names it
        self.path = path
        self._answer = answer
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(os.fspath(path))
        os.chmod(path, 0o600)  # the directory (0700, checked) already keeps others out
        self._sock.listen(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._accept_errors = 0  # failed accepts (e.g. EMFILE), for tests and logs
        self._logged_at = -1e9
        # the accept loop survives what a peer or the host causes (below); a bug of ours that
        # ends it anyway restarts it, and one that keeps ending it closes the socket, so the
        # scheduler's lookups fail at once (misses) instead of waiting on a deaf listener
        self._loop = SupervisedLoop(
            self._accept, name="tpusync-vllm-lookups", on_failure=lambda _: self._deafen()
        )
        self._loop.start()

    @property
    def failure(self) -> BaseException | None:
        """The accept loop's last error when it was given up on (None: it serves)."""
        return self._loop.failure

    def _deafen(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError as error:
                if self._closed.is_set():
                    return
                # out of descriptors or memory, or a peer gone before its accept: this peer's
                # problem or a passing one, not a reason to stop serving the others
                self._accept_failed(error)
                self._closed.wait(ACCEPT_PAUSE_S)
                continue
            try:
                self._admit(conn)
            except Exception as error:  # e.g. no thread could start: this connection only
                self._accept_failed(error)
                with self._lock:
                    self._connections.discard(conn)
                conn.close()

    def _accept_failed(self, error: BaseException) -> None:
        self._accept_errors += 1
        now = time.monotonic()
        if now - self._logged_at >= 5.0:  # a line per 5 s: EMFILE repeats at every accept
            self._logged_at = now
            log.warning(
                "tpusync vllm: accepting a lookup connection failed (%d so far): %s",
                self._accept_errors,
                error,
            )

    def _admit(self, conn: socket.socket) -> None:
        """Checks a new connection's uid and room, and serves it on a thread of its own."""
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        _, uid, _ = struct.unpack("3i", creds)
        with self._lock:
            full = len(self._connections) >= MAX_CONNECTIONS
            if uid != os.getuid() or full or self._closed.is_set():
                conn.close()
                if uid != os.getuid():
                    log.warning("tpusync vllm: refused a lookup connection of uid %d", uid)
                return
            self._connections.add(conn)
        threading.Thread(
            target=self._serve, args=(conn,), name="tpusync-vllm-lookup", daemon=True
        ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = _recv_exactly(conn, 4)
                if head is None:
                    return
                (length,) = struct.unpack("<I", head)
                if length > MAX_BODY_BYTES:
                    log.warning("tpusync vllm: a lookup of %d bytes was refused", length)
                    return
                body = _recv_exactly(conn, length)
                if body is None:
                    return
                try:
                    req_id, sequence, hashes = decode_request(body)
                except (ValueError, UnicodeDecodeError) as error:
                    log.warning("tpusync vllm: a malformed lookup was refused (%s)", error)
                    return
                blocks, is_async = self._answer(req_id, sequence, hashes)
                conn.sendall(_ANSWER.pack(blocks, is_async))
        except OSError:
            return
        except Exception:  # the answer failed: this connection's scheduler sees a miss
            log.exception("tpusync vllm: a lookup failed")
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stops serving, closes every connection and removes the socket."""
        self._closed.set()
        self._loop.stop()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            for conn in self._connections:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self._loop.join(timeout=5)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class LookupClient:
    """The scheduler's end: one connection, opened on first use and again after a failure.

    :meth:`lookup` answers ``None`` when the worker does not answer within ``timeout_s`` (not
    started yet, stuck, gone): the caller counts a miss and releases that lookup's pins."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None

    def _round_trip(self, message: bytes) -> tuple[int, bool] | None:
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                try:
                    sock.connect(os.fspath(self.path))
                except OSError:
                    sock.close()
                    raise
                self._sock = sock
            self._sock.sendall(message)
            answer = _recv_exactly(self._sock, _ANSWER.size)
            if answer is None:
                raise ConnectionError("the worker closed the lookup connection")
        except OSError as error:  # timeouts included: the next answer on it could be stale
            self.close()
            log.debug("tpusync vllm: no lookup answer from %s: %s", self.path, error)
            return None
        blocks, is_async = _ANSWER.unpack(answer)
        return blocks, bool(is_async)

    def lookup(self, req_id: str, sequence: int, hashes: list[bytes]) -> tuple[int, bool] | None:
        return self._round_trip(encode_request(req_id, sequence, hashes))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
