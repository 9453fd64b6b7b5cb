"""The registries' real servers and stand-ins the tests share: a redis-server started and stopped
by pid, and an in-memory stand-in of JAX's coordination-service client whose semantics and errors
tests/testing/test_conformance.py checks against the real service."""

from __future__ import annotations

import bisect
import socket
import subprocess
import threading
import time

from jax.errors import JaxRuntimeError
from tools import require_tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """Stops a child we started, by its pid: terminate, wait, kill."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def start_redis(port: int) -> subprocess.Popen:
    """A redis-server on ``port``, answering (where none is installed the test skips, or fails
    in CI: see tests/helpers/tools.py)."""
    server = require_tool("redis-server", "redis-server")
    import redis

    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        client = redis.Redis(
            host="127.0.0.1", port=port, socket_timeout=1, socket_connect_timeout=1
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {port}") from None
                time.sleep(0.05)
        client.close()
    except BaseException:
        stop(proc)
        raise
    return proc


def _grpc_error(status: str, code: int, message: str, method: str, tail: str = "") -> Exception:
    """The error the real client raises: a JaxRuntimeError whose first line is ``STATUS:
    message``, gRPC details after it (their order varies from call to call on the real service; text
    as jax 0.10.2's). tests/testing/test_conformance.py compares the type and first line with what a
    real coordination service raises."""
    return JaxRuntimeError(
        f"{status}: {message}\nAdditional GRPC error information from remote target "
        f"coordination_service while calling /xla.coordination.CoordinationService/{method}:\n"
        f':UNKNOWN:Error received from peer  {{grpc_message:"{message}", grpc_status:{code}}}'
        + tail
    )


class FakeCoordinationClient:
    """The key-value calls of jax's DistributedRuntimeClient, in memory, with the semantics and
    errors of the real one (checked against a real coordination service by
    tests/testing/test_conformance.py): a directory get lists the keys below ``key/``, a delete
    drops the key and its subtree, a missing key is ``NOT_FOUND: Config key ... not found.`` with
    gRPC details after it. Keys are kept sorted, so a directory get is a range, as on the
    service."""

    def __init__(self) -> None:
        self._kv: dict[str, str] = {}
        self._sorted: list[str] = []
        self._lock = threading.Lock()

    def _range(self, start_key: str) -> tuple[int, int]:
        """Where the stored keys that start with ``start_key`` lie in the sorted list."""
        start = bisect.bisect_left(self._sorted, start_key)
        return start, bisect.bisect_left(self._sorted, start_key + "\U0010ffff", start)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._lock:
            if key in self._kv:
                if not allow_overwrite:
                    message = f"key {key} already exists."
                    raise _grpc_error("ALREADY_EXISTS", 6, message, "InsertKeyValue")
            else:
                bisect.insort(self._sorted, key)
            self._kv[key] = value

    def key_value_try_get(self, key: str) -> str:
        with self._lock:
            if key not in self._kv:
                message = f"Config key {key} not found."
                tail = " [type.googleapis.com/tensorflow.CoordinationServiceError='']"
                raise _grpc_error("NOT_FOUND", 5, message, "TryGetKeyValue", tail)
            return self._kv[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        with self._lock:
            start, end = self._range(key.rstrip("/") + "/")
            return [(k, self._kv[k]) for k in self._sorted[start:end]]

    def key_value_delete(self, key: str) -> None:
        with self._lock:
            start, end = self._range(key + "/")
            for k in self._sorted[start:end]:
                del self._kv[k]
            del self._sorted[start:end]
            if self._kv.pop(key, None) is not None:
                del self._sorted[bisect.bisect_left(self._sorted, key)]
