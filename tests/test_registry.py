"""Registry backends: every backend runs the same test bodies (memory, remote over TCP, Redis, and
JAX on an in-process stand-in of the coordination service), plus the wire protocol's security and
robustness, and JaxRegistry across 2 real jax.distributed processes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tpusync.cluster import (
    AuthenticationError,
    Holder,
    JaxRegistry,
    MemoryRegistry,
    NodeInfo,
    RedisRegistry,
    RegistryServer,
    RegistryUnavailableError,
    RemoteRegistry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync.errors import InvalidArgumentError, TpuSyncError

SECRET = b"s" * 32
HERE = Path(__file__).parent
SHORT_TTL = 0.4
LAPSE = 0.6  # sleep long enough for SHORT_TTL to lapse


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


# -- backends ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free port for this session (skipped only where none is
    installed)."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    import redis

    port = free_port()
    proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
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
        yield url
    finally:
        stop(proc)


class FakeCoordinationClient:
    """The key-value calls of jax's DistributedRuntimeClient, in memory, with the semantics the
    2-process test checks on the real one (directory get; delete = key and its subtree)."""

    def __init__(self) -> None:
        self._kv: dict[str, str] = {}
        self._lock = threading.Lock()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self._lock:
            if key in self._kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self._kv[key] = value

    def key_value_try_get(self, key: str) -> str:
        with self._lock:
            if key not in self._kv:
                raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
            return self._kv[key]

    def key_value_dir_get(self, key: str) -> list[tuple[str, str]]:
        d = key.rstrip("/") + "/"
        with self._lock:
            return sorted((k, v) for k, v in self._kv.items() if k.startswith(d))

    def key_value_delete(self, key: str) -> None:
        with self._lock:
            for k in [k for k in self._kv if k == key or k.startswith(key + "/")]:
                del self._kv[k]


BACKENDS = ["memory", "remote", "redis", "jax-fake"]


@pytest.fixture(params=BACKENDS)
def make(request: pytest.FixtureRequest) -> Iterator[Callable[[], Any]]:
    """Makes registries of one backend; all made in one test share one store (two clients of
    one registry, where the backend has clients)."""
    closers: list[Callable[[], None]] = []
    kind = request.param
    if kind == "memory":
        shared = MemoryRegistry()

        def factory() -> Any:
            return shared

    elif kind == "remote":
        server = RegistryServer(MemoryRegistry(), secret=SECRET)
        closers.append(server.close)

        def factory() -> Any:
            client = RemoteRegistry(server.address, secret=SECRET)
            closers.append(client.close)
            return client

    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        prefix = f"t{uuid.uuid4().hex[:10]}"

        def factory() -> Any:
            client = RedisRegistry(url, prefix=prefix)
            closers.append(client.close)
            return client

    else:
        fake = FakeCoordinationClient()

        def factory() -> Any:
            client = JaxRegistry(prefix="test/reg", client=fake)
            closers.append(client.close)
            return client

    yield factory
    for close in reversed(closers):
        close()


@pytest.fixture
def registry(make: Callable[[], Any]) -> Any:
    return make()


def k(i: int, length: int = 16) -> bytes:
    return i.to_bytes(4, "big") * (length // 4) + bytes(length % 4)


def ids(holders: list[list[Holder]]) -> list[list[str]]:
    return [[h.node_id for h in held] for held in holders]


# -- the protocol, on every backend --------------------------------------------------------------


def test_register_heartbeat_unregister(registry: Any) -> None:
    a = NodeInfo("node-a", ("10.0.0.1:5000", "10.0.1.1:5000"), group="g", shard_rank=0)
    registry.register(a, 30)
    registry.register(NodeInfo("node-b/with:odd chars%"), 30)
    assert sorted(n.node_id for n in registry.nodes()) == ["node-a", "node-b/with:odd chars%"]
    assert next(n for n in registry.nodes() if n.node_id == "node-a") == a
    assert registry.heartbeat("node-a", 30) is True
    assert registry.heartbeat("nobody", 30) is False
    registry.publish("node-a", [k(1)], "dram")
    registry.unregister("node-a")
    registry.unregister("nobody")  # a no-op
    assert [n.node_id for n in registry.nodes()] == ["node-b/with:odd chars%"]
    assert registry.heartbeat("node-a", 30) is False
    assert registry.holders([k(1)]) == [[]]
    # registering again while alive refreshes the record and keeps the entries
    registry.register(a, 30)
    registry.publish("node-a", [k(2)], "disk")
    a2 = NodeInfo("node-a", ("10.0.0.9:5000",), group="g")
    registry.register(a2, 30)
    assert registry.holders([k(2)]) == [[Holder("node-a", "disk")]]
    assert next(n for n in registry.nodes() if n.node_id == "node-a") == a2


def test_publish_withdraw_holders_sorted(make: Callable[[], Any]) -> None:
    r1, r2 = make(), make()
    for name in ("zeta", "alpha", "mid"):
        r1.register(NodeInfo(name), 30)
    r1.publish("zeta", [k(1), k(2)], "dram")
    r2.publish("alpha", [k(1)], "disk")
    r1.publish("mid", [k(1), k(3, 32)], "shm")
    r1.publish("mid", [k(1)], "disk")  # republish: the tier is replaced
    r1.publish("mid", [], "disk")  # nothing
    found = r2.holders([k(1), k(2), k(3, 32), k(4), k(1)])
    assert found == [
        [Holder("alpha", "disk"), Holder("mid", "disk"), Holder("zeta", "dram")],
        [Holder("zeta", "dram")],
        [Holder("mid", "shm")],
        [],
        [Holder("alpha", "disk"), Holder("mid", "disk"), Holder("zeta", "dram")],
    ]
    assert [h.tier for h in found[0]] == ["disk", "disk", "dram"]
    r2.withdraw("mid", [k(1), k(9)])  # k(9) was never published: ignored
    r1.withdraw("zeta", [k(2)])
    r1.withdraw("nobody", [k(1)])
    assert ids(r1.holders([k(1), k(2), k(3, 32)])) == [["alpha", "zeta"], [], ["mid"]]
    assert r1.holders([]) == []
    # a 512-key lookup
    keys = [k(i) for i in range(512)]
    r1.publish("alpha", keys[::2], "dram")
    found = r2.holders(keys)
    assert [bool(h) for h in found] == [i % 2 == 0 or i == 1 for i in range(512)]


def test_lease_lapse_and_reregister(registry: Any) -> None:
    registry.register(NodeInfo("short"), SHORT_TTL)
    registry.register(NodeInfo("long"), 30)
    registry.publish("short", [k(1), k(2)], "dram")
    registry.publish("long", [k(1)], "disk")
    assert ids(registry.holders([k(1), k(2)])) == [["long", "short"], ["short"]]
    time.sleep(LAPSE)
    # lapsed: its entries stop counting at once, before any sweep
    assert ids(registry.holders([k(1), k(2)])) == [["long"], []]
    assert [n.node_id for n in registry.nodes()] == ["long"]
    assert registry.heartbeat("short", 30) is False
    with pytest.raises(InvalidArgumentError, match="register it first"):
        registry.publish("short", [k(3)], "dram")
    assert registry.holders([k(3)]) == [[]]
    # registering again voids the old entries: it must re-publish what it still holds
    registry.register(NodeInfo("short"), 30)
    assert ids(registry.holders([k(1), k(2)])) == [["long"], []]
    registry.publish("short", [k(2)], "disk")
    assert registry.holders([k(1), k(2)]) == [[Holder("long", "disk")], [Holder("short", "disk")]]
    # a heartbeat keeps a lease alive past its first TTL
    registry.register(NodeInfo("beating"), 0.6)
    registry.publish("beating", [k(5)], "dram")
    for _ in range(5):
        time.sleep(0.15)
        assert registry.heartbeat("beating", 0.6) is True
    assert ids(registry.holders([k(5)])) == [["beating"]]


def test_sweep(registry: Any) -> None:
    registry.register(NodeInfo("a"), SHORT_TTL)
    registry.register(NodeInfo("b"), SHORT_TTL)  # no entries: still a node to sweep
    registry.register(NodeInfo("c"), 30)
    registry.publish("a", [k(1), k(2)], "dram")
    registry.publish("c", [k(2)], "dram")
    assert registry.sweep() == 0
    time.sleep(LAPSE)
    assert registry.sweep() == 2
    assert registry.sweep() == 0
    assert ids(registry.holders([k(1), k(2)])) == [[], ["c"]]
    # after the sweep "a" is unknown; registering it again starts clean
    assert registry.heartbeat("a", 30) is False
    registry.register(NodeInfo("a"), 30)
    assert ids(registry.holders([k(1), k(2)])) == [[], ["c"]]
    assert sorted(n.node_id for n in registry.nodes()) == ["a", "c"]


def test_longest_prefix_across_shards(make: Callable[[], Any]) -> None:
    shard0, shard1 = make(), make()
    shard0.register(NodeInfo("g-0", group="g", shard_rank=0, shard_count=2), 30)
    shard1.register(NodeInfo("g-1", group="g", shard_rank=1, shard_count=2), 30)
    keys0 = [k(100 + i) for i in range(6)]  # each shard stores its part under its own keys
    keys1 = [k(200 + i) for i in range(6)]
    shard0.publish("g-0", keys0, "dram")
    shard1.publish("g-1", keys1[:2] + keys1[3:], "dram")  # shard 1 lacks block 2
    assert longest_prefix(shard0, keys0) == (6, [[Holder("g-0", "dram")]] * 6)
    assert longest_prefix(shard0, keys0, exclude="g-0") == (0, [])
    assert longest_prefix(shard0, keys1)[0] == 2
    assert longest_common_prefix(shard1, [keys0, keys1]) == 2
    assert longest_common_prefix(shard1, [keys0[:1], keys1]) == 1
    assert longest_common_prefix(shard1, []) == 0
    shard1.publish("g-1", [keys1[2]], "disk")
    assert longest_common_prefix(shard0, [keys0, keys1]) == 6
    shard0.withdraw("g-0", [keys0[4]])
    assert longest_common_prefix(shard0, [keys0, keys1]) == 4


BAD_CALLS: list[tuple[str, Callable[[Any], Any]]] = [
    ("key not bytes", lambda r: r.publish("live", [k(1), "text"], "dram")),
    ("bytearray key", lambda r: r.publish("live", [bytearray(k(1))], "dram")),
    ("key too long", lambda r: r.publish("live", [k(1), b"x" * 33], "dram")),
    ("empty key", lambda r: r.publish("live", [b""], "dram")),
    ("bad tier", lambda r: r.publish("live", [k(1)], 3)),
    ("empty tier", lambda r: r.publish("live", [k(1)], "")),
    ("unregistered", lambda r: r.publish("ghost", [k(1)], "dram")),
    ("withdraw bad key", lambda r: r.withdraw("live", [k(0), b"y" * 40])),
    ("holders bad key", lambda r: r.holders([k(0), 5])),
    ("ttl zero", lambda r: r.register(NodeInfo("new"), 0)),
    ("ttl negative", lambda r: r.register(NodeInfo("new"), -1)),
    ("ttl not a number", lambda r: r.register(NodeInfo("new"), "10")),
    ("ttl bool", lambda r: r.register(NodeInfo("new"), True)),
    ("heartbeat ttl", lambda r: r.heartbeat("live", 0)),
    ("node not NodeInfo", lambda r: r.register({"node_id": "new"}, 10)),
]


@pytest.mark.parametrize("call", [c for _, c in BAD_CALLS], ids=[n for n, _ in BAD_CALLS])
def test_bad_input_changes_nothing(registry: Any, call: Callable[[Any], Any]) -> None:
    registry.register(NodeInfo("live"), 30)
    registry.publish("live", [k(0)], "shm")
    before = (registry.holders([k(0), k(1)]), registry.nodes())
    with pytest.raises(InvalidArgumentError) as info:
        call(registry)
    assert isinstance(info.value, ValueError | TpuSyncError)
    assert (registry.holders([k(0), k(1)]), registry.nodes()) == before


def test_concurrent_publish_withdraw(make: Callable[[], Any]) -> None:
    threads_n, rounds = 6, 20
    clients = [make() for _ in range(threads_n)]
    for i in range(threads_n):
        clients[0].register(NodeInfo(f"n{i}"), 30)
    shared = [k(1000 + j) for j in range(8)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            r, me = clients[i], f"n{i}"
            mine = [k(i * 100 + j) for j in range(10)]
            for step in range(rounds):
                r.publish(me, mine + shared, "dram")
                r.withdraw(me, mine[step % 10 :: 3])
                r.holders(mine + shared)
            r.withdraw(me, shared[i % 2 :: 2])  # leave every other shared key
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    found = clients[0].holders(shared)
    for j, held in enumerate(found):
        assert ids([held]) == [[f"n{i}" for i in range(threads_n) if j % 2 != i % 2]]
    for i in range(threads_n):
        mine = [k(i * 100 + j) for j in range(10)]
        last = set(mine[(rounds - 1) % 10 :: 3])
        assert [bool(h) for h in clients[1].holders(mine)] == [m not in last for m in mine]
    for i in range(threads_n):
        clients[2].unregister(f"n{i}")
    assert clients[0].holders(shared) == [[]] * len(shared)
    assert clients[0].nodes() == []


# -- Redis specifics -----------------------------------------------------------------------------


def test_redis_lookup_is_few_round_trips(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import redis.connection

    registry = RedisRegistry(redis_url, prefix=f"t{uuid.uuid4().hex[:10]}")
    try:
        keys = [k(i, 32) for i in range(512)]
        for n in range(3):
            registry.register(NodeInfo(f"n{n}"), 30)
        registry.publish("n0", keys, "dram")
        registry.publish("n1", keys[:100], "disk")
        registry.nodes()  # loads nothing new; warms the connection
        sends = []
        real = redis.connection.Connection.send_packed_command

        def counting(self: Any, command: Any, check_health: bool = True) -> None:
            sends.append(1)
            return real(self, command, check_health)

        monkeypatch.setattr(redis.connection.Connection, "send_packed_command", counting)
        found = registry.holders(keys)
        assert len(sends) <= 3, f"{len(sends)} round trips for a 512-key lookup"
        assert ids(found) == [["n0", "n1"]] * 100 + [["n0"]] * 412
        sends.clear()
        registry.publish("n2", keys, "shm")
        registry.withdraw("n2", keys)
        assert len(sends) <= 4, f"{len(sends)} round trips for a 512-key publish + withdraw"
    finally:
        registry.close()


def test_redis_unreachable_raises() -> None:
    registry = RedisRegistry(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1)
    with pytest.raises(RegistryUnavailableError, match="failed holders") as info:
        registry.holders([k(1)])
    assert isinstance(info.value, ConnectionError)
    registry.close()


# -- RegistryServer / RemoteRegistry -------------------------------------------------------------


@pytest.fixture
def server() -> Iterator[RegistryServer]:
    srv = RegistryServer(MemoryRegistry(), secret=SECRET)
    yield srv
    srv.close()


def _works(server: RegistryServer) -> None:
    with RemoteRegistry(server.address, secret=SECRET, timeout_s=5) as client:
        client.register(NodeInfo("probe"), 30)
        client.publish("probe", [k(7)], "dram")
        assert client.holders([k(7)]) == [[Holder("probe", "dram")]]
        client.unregister("probe")


def test_remote_wrong_secret_rejected(server: RegistryServer) -> None:
    with pytest.raises(AuthenticationError, match="rejected this client's secret") as info:
        RemoteRegistry(server.address, secret=b"x" * 32)
    assert isinstance(info.value, PermissionError)
    # a server started with another secret rejects a client of ours the same way
    with (
        RegistryServer(MemoryRegistry(), secret=b"o" * 32) as other,
        pytest.raises(AuthenticationError),
    ):
        RemoteRegistry(other.address, secret=SECRET)
    _works(server)


def test_remote_impostor_server_rejected() -> None:
    """A server that does not know the secret but accepts every client is caught by the
    client's check of the server's MAC."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            send(conn, {"hello": "tpusync-registry", "version": 1, "nonce": os.urandom(32).hex()})
            recv(conn)
            send(conn, {"mac": os.urandom(32).hex()})
            with contextlib.suppress(EOFError, OSError):
                recv(conn)

    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    try:
        with pytest.raises(AuthenticationError, match="does not know the shared secret"):
            RemoteRegistry(f"127.0.0.1:{port}", secret=SECRET, timeout_s=5)
    finally:
        thread.join(timeout=5)
        listener.close()


def test_remote_secret_and_address_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="secret"):
        RegistryServer(MemoryRegistry(), secret=b"short")
    with pytest.raises(InvalidArgumentError, match="secret"):
        RemoteRegistry("127.0.0.1:1", secret="a string secret, not bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="address"):
        RemoteRegistry("no-port", secret=SECRET)
    with pytest.raises(RegistryUnavailableError, match="cannot connect"):
        RemoteRegistry(f"127.0.0.1:{free_port()}", secret=SECRET, timeout_s=2)


def send_raw(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(struct.pack(">I", len(payload)) + payload)


def send(sock: socket.socket, obj: Any) -> None:
    send_raw(sock, json.dumps(obj).encode())


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def recv(sock: socket.socket) -> Any:
    (n,) = struct.unpack(">I", recv_exact(sock, 4))
    return json.loads(recv_exact(sock, n))


def authenticated(server: RegistryServer) -> socket.socket:
    """A raw socket through the handshake, for sending arbitrary frames."""
    import hashlib
    import hmac

    host, port = server.address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=5)
    nonce_s = bytes.fromhex(recv(sock)["nonce"])
    nonce_c = os.urandom(32)
    mac = hmac.new(SECRET, b"client" + nonce_s + nonce_c, hashlib.sha256).hexdigest()
    send(sock, {"nonce": nonce_c.hex(), "mac": mac})
    assert "mac" in recv(sock)
    return sock


def raw(server: RegistryServer) -> socket.socket:
    host, port = server.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_server_survives_malformed_input(server: RegistryServer) -> None:
    # before authentication: garbage, an oversized length, a wrong MAC, silence then close
    for payload in (
        b"\x00\x01garbage" * 50,
        struct.pack(">I", 2**31) + b"x" * 100,
        struct.pack(">I", 5) + b"nojs!",
        struct.pack(">I", 2) + b"{}",
    ):
        with raw(server) as sock:
            recv(sock)  # the hello
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)  # a partial frame ends here
            except OSError:
                pass  # the server already closed the connection
            answers = []
            try:
                while True:  # an error frame at most, then the server closes
                    answers.append(recv(sock))
            except (EOFError, ConnectionError):
                pass
            assert all(a["error"]["type"] for a in answers), answers
            assert len(answers) <= 1
    with raw(server):
        pass
    # after authentication: bad frames get error responses and the connection stays usable
    with authenticated(server) as sock:
        cases: list[tuple[bytes, str]] = [
            (b"not json", "ProtocolError"),
            (b"\xff\xfe", "ProtocolError"),
            (b"[1, 2]", "ProtocolError"),
            (b'{"id": "x", "method": "ping"}', "ProtocolError"),
            (b'{"id": 1, "method": "nope"}', "ProtocolError"),
            (b'{"id": 2, "method": "ping", "params": []}', "ProtocolError"),
            (b'{"id": 3, "method": "holders", "params": {"keys": ["zz"]}}', "InvalidArgument"),
            (b'{"id": 4, "method": "holders", "params": {"keys": "00"}}', "InvalidArgument"),
            (b'{"id": 5, "method": "register", "params": {"node": 5, "ttl_s": 1}}', "Invalid"),
            (b'{"id": 6, "method": "register", "params": {"node": {"node_id": "a", '
             b'"shard_rank": "0"}, "ttl_s": 1}}', "InvalidArgument"),
            (b'{"id": 7, "method": "publish", "params": {"node_id": 7, "keys": [], '
             b'"tier": "t"}}', "InvalidArgument"),
            (b'{"id": 8, "method": "heartbeat", "params": {"node_id": "a", "ttl_s": null}}',
             "InvalidArgument"),
        ]  # fmt: skip
        for payload, kind in cases:
            send_raw(sock, payload)
            answer = recv(sock)
            assert answer["error"]["type"].startswith(kind), (payload, answer)
        send(sock, {"id": 9, "method": "ping"})
        assert recv(sock) == {"id": 9, "result": "pong"}
        sock.sendall(struct.pack(">I", 17 * 2**20))  # oversized after auth: closed
        assert recv(sock)["error"]["type"] == "ProtocolError"
        with pytest.raises((EOFError, ConnectionError)):
            recv(sock)
    _works(server)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    frames=st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.fixed_dictionaries(
                {"id": st.one_of(st.none(), st.integers(), st.text(max_size=3))},
                optional={
                    "method": st.sampled_from(
                        ["ping", "register", "heartbeat", "unregister", "publish", "withdraw",
                         "holders", "nodes", "sweep", "close", "__init__", ""]
                    ),
                    "params": st.one_of(
                        st.dictionaries(
                            st.sampled_from(["node", "node_id", "keys", "tier", "ttl_s"]),
                            st.recursive(
                                st.none() | st.booleans() | st.integers() | st.floats()
                                | st.text(max_size=8),
                                lambda inner: st.lists(inner, max_size=3)
                                | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                                max_leaves=6,
                            ),
                        ),
                        st.integers(),
                    ),
                },
            ).map(lambda d: json.dumps(d).encode()),
        ),
        min_size=1,
        max_size=6,
    )
)  # fmt: skip
def test_server_fuzz(server: RegistryServer, frames: list[bytes]) -> None:
    with authenticated(server) as sock:
        for frame in frames:
            send_raw(sock, frame)
            answer = recv(sock)
            assert isinstance(answer, dict) and ("result" in answer or "error" in answer)
        send(sock, {"id": 1, "method": "ping"})
        assert recv(sock)["result"] == "pong"
    _works(server)


def test_remote_reconnects_once_and_times_out(server: RegistryServer) -> None:
    client = RemoteRegistry(server.address, secret=SECRET, timeout_s=5)
    client.register(NodeInfo("n"), 30)
    assert client._sock is not None
    client._sock.shutdown(socket.SHUT_RDWR)  # the connection breaks under the client
    assert client.heartbeat("n", 30) is True  # reconnected
    client.close()
    with pytest.raises(RegistryUnavailableError, match="closed"):
        client.nodes()
    # a peer that authenticates nothing and never answers: every socket op times out
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        start = time.monotonic()
        with pytest.raises(RegistryUnavailableError, match="handshake"):
            RemoteRegistry(f"127.0.0.1:{silent.getsockname()[1]}", secret=SECRET, timeout_s=0.3)
        assert time.monotonic() - start < 3
    finally:
        silent.close()


def test_server_drops_silent_peers() -> None:
    with RegistryServer(MemoryRegistry(), secret=SECRET, handshake_timeout_s=0.3) as srv:
        with raw(srv) as sock:
            recv(sock)  # the hello; then say nothing
            sock.sendall(struct.pack(">I", 100) + b"partial")
            start = time.monotonic()
            with pytest.raises((EOFError, ConnectionError)):
                recv(sock)
            assert time.monotonic() - start < 3
        _works(srv)


def test_server_close_stops_everything() -> None:
    srv = RegistryServer(MemoryRegistry(), secret=SECRET)
    clients = [RemoteRegistry(srv.address, secret=SECRET, timeout_s=2) for _ in range(3)]
    idle = raw(srv)  # connected, never authenticates
    before = threading.active_count()
    start = time.monotonic()
    srv.close()
    srv.close()  # idempotent
    assert time.monotonic() - start < 3
    assert threading.active_count() <= before - 4  # acceptor + 4 connection threads gone
    for client in clients:
        with pytest.raises(RegistryUnavailableError):
            client.nodes()
        client.close()
    idle.close()


# -- JAX -----------------------------------------------------------------------------------------


def test_jax_registry_needs_initialize() -> None:
    from jax._src.distributed import global_state

    if global_state.client is not None:
        pytest.skip("jax.distributed is initialized in this test process")
    with pytest.raises(InvalidArgumentError, match=r"jax.distributed.initialize"):
        JaxRegistry()


def test_jax_registry_two_processes(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    procs, logs = [], []
    for i in range(2):
        out, err = tmp_path / f"child{i}.out", tmp_path / f"child{i}.err"
        logs.append((out, err))
        with out.open("w") as fout, err.open("w") as ferr:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / "registry_jax_child.py"), str(i), str(port)],
                    stdout=fout,
                    stderr=ferr,
                    env=env,
                )
            )
    outputs = []
    deadline = time.monotonic() + 25
    try:
        for proc, (out, err) in zip(procs, logs, strict=True):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            assert code == 0, f"child {proc.args[2]} failed ({code}):\n{err.read_text()[-3000:]}"
            outputs.append(json.loads(out.read_text().strip().splitlines()[-1]))
    finally:
        for proc in procs:
            stop(proc)
    seen = outputs[1]
    both = [["p0/a", "dram"], ["p0/b", "disk"]]
    assert seen["holders"] == [[*both, ["short", "shm"]], both, [both[0]], [both[0]]]
    assert seen["nodes"] == ["p0/a", "p0/b", "short"]
    assert seen["longest"] == 4
    assert seen["common"] == 4
    assert seen["common_ab"] == 2
    assert seen["holders_after_lapse"] == [both]
    assert seen["short_heartbeat"] is False
    assert seen["swept"] == 1
    assert seen["holders_final"] == [[], [both[0]], [both[0]], [both[0]]]
    assert seen["nodes_final"] == ["p0/a"]
