"""Hostile network peers against every tpusync server (registry server, block server, store
node), before and after authentication. Real sockets on loopback; where memory and threads
matter, the real server runs in a child process (``tests/helpers/preauth_child.py``, stopped by pid)
and is read through /proc.

* 256 hostile peers at once, on one asyncio loop here (random bytes, trickles, huge lengths,
  silence, wrong MACs, thousands of connections opened and dropped): the server's RSS grows by
  at most 64 MiB, its threads stay bounded, and a legitimate client is served within 1 s,
  again and again during the attack;
* one deadline for the whole handshake (a trickle does not hold a place past it), a budget of
  unauthenticated connections apart from the authenticated ones, refusals logged at most once
  per reason every few seconds;
* a damaged frame header during a push to a store node: a miss for that push, one line in the
  server's log, and the next push succeeds.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import queue
import random
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from paths import HELPERS
from preauth_child import BLOCKS, LAYOUT, key_for, payload_for
from tools import self_signed_tls

from tpusync._src.cluster.dataplane import wire
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    RegistryServer,
    RemoteRegistry,
    StoreNodePool,
    StoreServer,
)
from tpusync.errors import AuthenticationError, InvalidArgumentError, RegistryUnavailableError
from tpusync.tiers import HostPool

CHILD = HELPERS / "preauth_child.py"
SECRET = bytes(range(40, 72))
KINDS = ["block", "store", "registry"]
PEERS = 256
RSS_GROWTH_MIB = 64
SERVED_WITHIN_S = 1.0
# Under the flood a legitimate connection can meet a full accept queue: its SYN is dropped
# and TCP sends it again after 1 s (one visit took 2.17 s beside the vLLM suite on 2 cores).
# The median visit keeps SERVED_WITHIN_S; none may take longer than this.
FLOOD_SERVED_WITHIN_S = 3.5
STEP_S = 30.0  # the longest wait for a child's line (its start-up included)
HOSTILE = ("random", "trickle", "huge", "churn", "silent", "badmac")


def _frame(obj: Any) -> bytes:
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


# -- the server in a child process -----------------------------------------------------------


class Child:
    """A preauth_child process: its stdout read on a thread (every wait has a deadline), its
    stderr in a file; :meth:`stop` closes its stdin, reads its refusal counts, and kills it by
    pid if it does not exit."""

    def __init__(self, kind: str, workdir: Path) -> None:
        self.stderr_path = workdir / f"preauth-{kind}.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), kind, SECRET.hex()],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.address = self.expect("ready").split()[1]
        self.refusals: dict[str, int] = {}

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def expect(self, prefix: str, timeout: float = STEP_S) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(f"the child did not say {prefix!r} in {timeout} s") from None
            if line is None:
                raise AssertionError(
                    f"the child exited before saying {prefix!r}:\n{self.stderr()[-3000:]}"
                )
            if line.startswith(prefix):
                return line

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def status(self) -> dict[str, int]:
        """VmRSS (KiB) and Threads of the child, from /proc."""
        out = {}
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "Threads"):
                    out[name] = int(value.split()[0])
        return out

    def stop(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.close()
                line = self.expect("refusals", timeout=10)
                self.refusals = json.loads(line.split(" ", 1)[1])
                self.proc.wait(timeout=10)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            if self.proc.stdout is not None:
                self.proc.stdout.close()


@contextlib.contextmanager
def child(kind: str, workdir: Path) -> Iterator[Child]:
    c = Child(kind, workdir)
    try:
        yield c
    finally:
        c.stop()


class Sampler:
    """Samples a child's VmRSS and thread count every few milliseconds; keeps the peaks."""

    def __init__(self, target: Child) -> None:
        self._child = target
        self.peak = target.status()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            with contextlib.suppress(OSError, ValueError):
                now = self._child.status()
                self.peak = {k: max(v, now[k]) for k, v in self.peak.items()}

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# -- the attackers: one asyncio loop, many sockets --------------------------------------------


class Attack:
    """``peers`` hostile peers on one asyncio loop (a thread of this process), each repeating
    its behaviour (see HOSTILE, dealt round robin) until :meth:`stop`: connect, misbehave,
    wait for the server to drop it, connect again."""

    def __init__(self, address: str, peers: int = PEERS, seed: int = 18) -> None:
        host, port = address.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.peers, self.seed = peers, seed
        self.opened: collections.Counter[str] = collections.Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._ready = threading.Event()
        self._halt = False
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> Attack:
        self._thread.start()
        assert self._ready.wait(10), "the attack did not start"
        deadline = time.monotonic() + 10
        while sum(self.opened.values()) < 2 * self.peers:  # every peer is at it before the clients
            if time.monotonic() > deadline:
                opened = dict(self.opened)
                self.__exit__(None, None, None)
                raise AssertionError(f"the attack did not get going: it opened only {opened}")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the attackers did not stop"

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        tasks = [asyncio.create_task(self._peer(i)) for i in range(self.peers)]
        self._ready.set()
        await self._stopping.wait()
        self._halt = True  # a cancel swallowed by a timeout's race still ends the loops
        for _ in range(20):
            for task in tasks:
                task.cancel()
            _, left = await asyncio.wait(tasks, timeout=0.25)
            if not left:
                return

    async def _peer(self, i: int) -> None:
        behaviour = HOSTILE[i % len(HOSTILE)]
        act = getattr(self, f"_{behaviour}")
        rng = random.Random(self.seed * 1000 + i)
        while not self._halt:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), 5
                )
            except (OSError, TimeoutError):
                await asyncio.sleep(0.01)  # a pause before the next try, not a wait for anything
                continue
            self.opened[behaviour] += 1
            try:
                await act(reader, writer, rng)
            except (OSError, TimeoutError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.transport.abort()

    @staticmethod
    async def _until_closed(reader: asyncio.StreamReader, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while await reader.read(65536):
                pass

    async def _random(self, reader: Any, writer: Any, rng: random.Random) -> None:
        writer.write(rng.randbytes(rng.randint(1, 4096)))
        await self._until_closed(reader, 5)

    async def _trickle(self, reader: Any, writer: Any, rng: random.Random) -> None:
        writer.write(struct.pack(">I", 1000))  # a length a handshake could have, then a drip
        async with asyncio.timeout(30):
            while not self._halt:
                writer.write(rng.randbytes(1))
                try:
                    async with asyncio.timeout(0.2):
                        if not await reader.read(65536):
                            return  # dropped by the server
                except TimeoutError:
                    pass

    async def _huge(self, reader: Any, writer: Any, rng: random.Random) -> None:
        length = rng.choice(
            [16 << 20, (16 << 20) - 1, 0xFFFFFFFF, 1 << 24 | rng.randrange(1 << 20)]
        )
        writer.write(struct.pack(">I", length) + rng.randbytes(64))
        await self._until_closed(reader, 30)

    async def _churn(self, reader: Any, writer: Any, rng: random.Random) -> None:
        if rng.random() < 0.5:
            await asyncio.sleep(0)  # dropped at once, or after a turn of the loop

    async def _silent(self, reader: Any, writer: Any, rng: random.Random) -> None:
        await self._until_closed(reader, 30)

    async def _badmac(self, reader: Any, writer: Any, rng: random.Random) -> None:
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        await reader.readexactly(n)  # the hello
        writer.write(_frame({"nonce": rng.randbytes(32).hex(), "mac": rng.randbytes(32).hex()}))
        await self._until_closed(reader, 5)


# -- legitimate clients ------------------------------------------------------------------------


def legitimate_client(kind: str, address: str, round_: int, source: HostPool | None) -> None:
    """One legitimate client's whole visit: connect, authenticate, do something, check it."""
    if kind == "registry":
        with RemoteRegistry(address, secret=SECRET, timeout_s=5) as registry:
            node = f"legit-{round_}"
            registry.register(NodeInfo(node), 30)
            registry.publish(node, [key_for(round_)], "dram")
            assert node in {h.node_id for h in registry.holders([key_for(round_)])[0]}
        return
    if kind == "block":
        keys = [key_for(i) for i in range(BLOCKS)]
        with (
            BlockClient(address, secret=SECRET, timeout_s=5) as client,
            HostPool(LAYOUT, BLOCKS) as target,
        ):
            assert client.pull(keys, target) == [True] * BLOCKS
            for i, key in enumerate(keys):
                with target.slot_memory(target.slot_of(key)) as memory:
                    assert bytes(memory[: LAYOUT.payload_bytes]) == payload_for(i)
        return
    assert source is not None
    keys = [key_for(1000 + 4 * (round_ % 16) + i) for i in range(4)]
    with (
        StoreNodePool(address, layout=LAYOUT, secret=SECRET, timeout_s=5) as node,
        HostPool(LAYOUT, 4) as target,
    ):
        assert node.put(keys, source) == 4
        node.get(keys, target)
        for key in keys:
            assert _payload(target, key) == _payload(source, key)
        assert node.delete(keys) == 4  # the next visit pushes them afresh


def bad_mac_visit(address: str) -> None:
    """One peer that reads the hello, answers with a random MAC and waits to be dropped."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        (n,) = struct.unpack(">I", _recv_exact(sock, 4))
        _recv_exact(sock, n)  # the hello
        sock.sendall(_frame({"nonce": os.urandom(32).hex(), "mac": os.urandom(32).hex()}))
        assert closed_within(sock, 5), "a wrong MAC did not end the connection"


def _payload(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None
    with pool.slot_memory(slot) as memory:
        return bytes(memory[: pool.layout.payload_bytes])


@pytest.fixture
def source(rng: np.random.Generator) -> Iterator[HostPool]:
    """Random blocks to push: key_for(1000 + i), never a zero byte."""
    with HostPool(LAYOUT, 64) as pool:
        keys = [key_for(1000 + i) for i in range(64)]
        reservation = pool.reserve(keys)
        for slot in reservation.slots.tolist():
            with pool.slot_memory(slot) as memory:
                memory[: LAYOUT.payload_bytes] = rng.integers(
                    1, 256, LAYOUT.payload_bytes, dtype=np.uint8
                ).tobytes()
        pool.commit(reservation, pool.hash_slots(reservation.slots))
        yield pool


# -- 256 hostile peers ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_hostile_peers_before_authentication_are_bounded(
    kind: str, tmp_path: Path, source: HostPool
) -> None:
    """256 hostile peers at once against the server in a child: its RSS grows by at most
    64 MiB, its threads stay bounded (no thread per unauthenticated peer), legitimate clients
    are served within 1 s (the median visit; none over FLOOD_SERVED_WITHIN_S) throughout, and
    the refusals are logged rate-limited."""
    with child(kind, tmp_path) as server:
        legitimate_client(kind, server.address, 0, source)  # the server's lazy parts, made
        baseline = server.status()
        rounds: list[float] = []
        started = time.monotonic()
        with Sampler(server) as sampler, Attack(server.address) as attack:
            # six visits at least, and on until thousands of connections came and went
            while len(rounds) < 6 or (
                sum(attack.opened.values()) < 2000 and time.monotonic() - started < 15
            ):
                start = time.monotonic()
                legitimate_client(kind, server.address, len(rounds) + 1, source)
                rounds.append(time.monotonic() - start)
                time.sleep(0.3)  # on purpose: the visits are spread over the attack
            opened = dict(attack.opened)
        attacked_s = time.monotonic() - started
        # Under the flood every bad-MAC peer may be the oldest and dropped before its MAC is
        # read; one more, once the flood is over, must be refused for its MAC.
        bad_mac_visit(server.address)
        log = server.stderr()
    refusals = server.refusals
    growth_mib = (sampler.peak["VmRSS"] - baseline["VmRSS"]) / 1024
    print(f"{kind}: rounds {[f'{r:.3f}' for r in rounds]} s, RSS +{growth_mib:.1f} MiB, "
          f"threads {baseline['Threads']} -> peak {sampler.peak['Threads']}, opened {opened}, "
          f"refusals {refusals}")  # fmt: skip
    assert sorted(rounds)[len(rounds) // 2] <= SERVED_WITHIN_S, rounds
    assert max(rounds) <= FLOOD_SERVED_WITHIN_S, rounds
    assert growth_mib <= RSS_GROWTH_MIB
    assert sampler.peak["Threads"] <= baseline["Threads"] + 16
    assert sum(opened.values()) >= 2000  # thousands opened and dropped
    assert all(opened[b] for b in HOSTILE), opened
    # Refused: the budget overflowed, oversized frames and wrong MACs were seen...
    assert refusals.get("too many unauthenticated connections (the oldest is dropped)", 0) > 0
    assert refusals.get("oversized handshake frame", 0) > 0
    assert refusals.get("authentication failed", 0) > 0
    # ... and logged at most once per reason every 5 s, with the peer's address.
    lines = [line for line in log.splitlines() if ": refused " in line]
    per_reason = collections.Counter(
        next(r for r in refusals if f": {r}" in line) for line in lines
    )
    assert max(per_reason.values()) <= attacked_s / 5 + 2, per_reason
    assert sum(refusals.values()) > 10 * len(lines)
    assert all("refused 127.0.0.1:" in line for line in lines)
    assert "Traceback" not in log


# -- the handshake's deadline and budgets, in this process --------------------------------------


@contextlib.contextmanager
def serving(kind: str, **kwargs: Any) -> Iterator[Any]:
    if kind == "registry":
        with RegistryServer(MemoryRegistry(), secret=SECRET, **kwargs) as server:
            yield server
    elif kind == "block":
        with HostPool(LAYOUT, BLOCKS) as pool, BlockServer(pool, secret=SECRET, **kwargs) as s:
            yield s
    else:
        with StoreServer(4 << 20, secret=SECRET, **kwargs) as server:
            yield server


def quick_client(kind: str, address: str) -> None:
    """A legitimate client that connects, authenticates and asks one thing."""
    if kind == "registry":
        with RemoteRegistry(address, secret=SECRET, timeout_s=5) as registry:
            registry.ping()
    else:
        layout = LAYOUT if kind == "store" else None
        with BlockClient(address, secret=SECRET, timeout_s=5, layout=layout) as client:
            assert client.contains([key_for(0)]) == [False]


def connect(server: Any) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (reading what it sends)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(4096):
                return True
    except TimeoutError:
        return False
    except OSError:
        return True
    return False


@pytest.mark.parametrize("kind", KINDS)
def test_the_handshake_has_one_deadline(kind: str) -> None:
    """A peer trickling a byte every 0.1 s (each far within the timeout) is dropped once the
    whole handshake's deadline passes."""
    with serving(kind, handshake_timeout_s=1.0) as server, connect(server) as sock:
        start = time.monotonic()
        sock.sendall(struct.pack(">I", 900))
        dropped = None
        while time.monotonic() - start < 4:
            try:
                sock.sendall(b"{")
            except OSError:
                dropped = time.monotonic() - start
                break
            if closed_within(sock, 0.1):
                dropped = time.monotonic() - start
                break
        assert dropped is not None and 0.8 <= dropped <= 2.5, dropped
        quick_client(kind, server.address)
        assert server.refusals().get("handshake deadline passed") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_unauthenticated_connections_have_a_budget_of_their_own(kind: str) -> None:
    """With 8 handshakes allowed and 2 authenticated connections: 40 silent peers push the
    oldest out of the handshake budget, none takes an authenticated place, and legitimate
    clients still get in at once."""
    with serving(kind, max_handshakes=8, max_connections=4) as server:
        silent = [connect(server) for _ in range(40)]
        try:
            dropped = sum(closed_within(s, 0.05) for s in silent[:32])
            start = time.monotonic()
            quick_client(kind, server.address)
            assert time.monotonic() - start < SERVED_WITHIN_S
            assert dropped >= 24  # the oldest went (those still queued in the kernel may not)
            assert server.refusals()[
                "too many unauthenticated connections (the oldest is dropped)"
            ] >= 32  # fmt: skip
        finally:
            for sock in silent:
                sock.close()


def test_authenticated_connections_beyond_the_budget_are_told_busy() -> None:
    with serving("registry", max_connections=2) as server:
        silent = [connect(server) for _ in range(20)]  # authenticating: not counted
        try:
            with (
                RemoteRegistry(server.address, secret=SECRET, timeout_s=5) as a,
                RemoteRegistry(server.address, secret=SECRET, timeout_s=5) as b,
            ):
                a.ping()
                b.ping()
                with pytest.raises(RegistryUnavailableError, match="refused the connection"):
                    RemoteRegistry(server.address, secret=SECRET, timeout_s=5)
            # refused twice: the client tries once more after a pause when it is shed
            assert server.refusals()["too many authenticated connections"] == 2
        finally:
            for sock in silent:
                sock.close()
        deadline = time.monotonic() + 5
        while True:  # the two threads end once their clients left
            try:
                RemoteRegistry(server.address, secret=SECRET, timeout_s=5).close()
                break
            except RegistryUnavailableError:
                assert time.monotonic() < deadline
                time.sleep(0.05)


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ...]:
    return self_signed_tls(tmp_path_factory.mktemp("tls"))


def test_the_deadline_covers_the_tls_handshake_too(
    tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext],
) -> None:
    """Under TLS: a peer trickling its ClientHello, and one that finishes TLS and then trickles
    the tpusync handshake, are both dropped at the one deadline; TLS clients get in meanwhile."""
    server_tls, client_tls = tls_contexts
    with serving("registry", handshake_timeout_s=1.0, tls=server_tls) as server:
        plain = connect(server)
        wrapped = client_tls.wrap_socket(connect(server), server_hostname="127.0.0.1")
        try:
            wrapped.recv(4096)  # the hello, through TLS
            start = time.monotonic()
            plain.sendall(b"\x16\x03\x01\x02\x00")  # a TLS record header: a ClientHello comes
            wrapped.sendall(struct.pack(">I", 900))
            ends: dict[str, float] = {}
            while len(ends) < 2 and time.monotonic() - start < 4:
                for name, sock in (("plain", plain), ("tls", wrapped)):
                    if name in ends:
                        continue
                    try:
                        sock.sendall(b"{")
                        if closed_within(sock, 0.05):
                            ends[name] = time.monotonic() - start
                    except (OSError, ssl.SSLError):
                        ends[name] = time.monotonic() - start
                with RemoteRegistry(server.address, secret=SECRET, tls=client_tls) as client:
                    client.ping()
            assert sorted(ends) == ["plain", "tls"], ends
            assert all(0.8 <= t <= 2.5 for t in ends.values()), ends
            assert server.refusals()["handshake deadline passed"] == 2
        finally:
            plain.close()
            wrapped.close()


def test_handshake_frames_are_capped_and_not_allocated_ahead() -> None:
    """Before authentication a frame may announce at most what a handshake needs: a 16 MiB
    length is refused at once, without waiting for (or allocating) its bytes."""
    with serving("block") as server, connect(server) as sock:
        sock.recv(4096)  # the hello
        start = time.monotonic()
        sock.sendall(struct.pack(">I", 16 << 20))
        assert closed_within(sock, 2)
        assert time.monotonic() - start < 1
        assert server.refusals()["oversized handshake frame"] == 1


def test_refusals_are_logged_at_most_once_per_reason_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from tpusync._src.cluster._admission import RefusalLog  # here: the file imports at any commit

    clock = [100.0]
    refusals = RefusalLog(logging.getLogger("tpusync.test"), lambda: "srv", 5.0, lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger="tpusync.test"):
        for i in range(30):
            refusals.refuse(f"10.0.0.{i}:1", "too slow")
        refusals.refuse("10.0.0.99:1", "wrong secret")
        clock[0] += 5.0
        refusals.refuse("10.0.0.50:1", "too slow", "3 s")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "srv: refused 10.0.0.0:1: too slow",
        "srv: refused 10.0.0.99:1: wrong secret",
        "srv: refused 10.0.0.50:1: too slow: 3 s "
        "(+29 more refused for this reason since the last such line)",
    ]
    assert refusals.counts() == {"too slow": 31, "wrong secret": 1}


def test_a_wrong_secret_is_still_told_and_counted() -> None:
    with serving("block") as server:
        with pytest.raises(AuthenticationError, match="rejected this client's secret"):
            BlockClient(server.address, secret=b"w" * 32, timeout_s=5)
        assert server.rejected == 1
        assert server.refusals()["authentication failed"] == 1


# -- a damaged frame header during a push -----------------------------------------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)


class DamagingProxy:
    """Forwards connections to ``target``. Client to server, it follows the protocol (JSON
    frames; after a ``put`` request, block frames up to END) and, while :attr:`damage` is set,
    flips one bit of the first BLOCK frame header it forwards (then clears it)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.damage = threading.Event()
        self.damaged = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._socks: list[socket.socket] = []
        self._spawn(self._accept)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            self._socks += [client, upstream]
            self._spawn(self._up, client, upstream)
            self._spawn(self._down, upstream, client)

    def _up(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                head = _recv_exact(src, 4)
                body = _recv_exact(src, struct.unpack(">I", head)[0])
                dst.sendall(head + body)
                try:
                    request = json.loads(body)
                except ValueError:
                    request = None
                if isinstance(request, dict) and request.get("method") == "put":
                    self._blocks(src, dst)
        except (OSError, EOFError):
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _blocks(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            header = _recv_exact(src, wire.HEADER_SIZE)
            frame = wire.decode_header(header, max_payload=1 << 30)
            payload = _recv_exact(src, frame.payload_length)
            if frame.frame_type == wire.BLOCK and self.damage.is_set():
                self.damage.clear()
                self.damaged += 1
                header = header[:20] + bytes([header[20] ^ 0x10]) + header[21:]
            dst.sendall(header + payload)
            if frame.frame_type == wire.END:
                return

    def _down(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() on Linux
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(timeout=5)


def test_a_damaged_put_header_is_a_miss_and_one_line(tmp_path: Path, source: HostPool) -> None:
    """A bit flipped in a pushed block's frame header (on the wire, by a proxy): that push's
    part over the damaged connection is a miss (no exception), the store node in the child
    logs one line (no traceback) and counts it, and the next push stores everything."""
    keys = [key_for(1000 + i) for i in range(8)]
    with child("store", tmp_path) as server:
        proxy = DamagingProxy(server.address)
        try:
            with StoreNodePool(
                proxy.address, layout=LAYOUT, secret=SECRET, timeout_s=5, connections=2
            ) as node:
                proxy.damage.set()
                stored = node.put(keys[:4], source)
                assert proxy.damaged == 1
                held = node.contains(keys[:4])
                # the damaged connection carried keys 0 and 2, or 1 and 3: those are misses
                assert stored == 2 and held in ([False, True, False, True], [True, False] * 2)
                assert node.put(keys, source) == 6  # the next push: everything else
                with HostPool(LAYOUT, 8) as target:
                    node.get(keys, target)
                    for key in keys:
                        assert _payload(target, key) == _payload(source, key)
            legitimate_client("store", server.address, 9, source)  # still serving others
            log = server.stderr()
        finally:
            proxy.close()
    damaged = [line for line in log.splitlines() if "damaged put frame" in line]
    assert len(damaged) == 1, log
    assert "crc" in damaged[0] and "refused 127.0.0.1:" in damaged[0]
    assert "Traceback" not in log
    assert server.refusals.get("damaged put frame (crc)") == 1


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_handshakes": 0}, "max_handshakes"),
        ({"max_handshakes": 2.5}, "max_handshakes"),
        ({"max_connections": 0}, "max_connections"),
        ({"handshake_timeout_s": 0}, "handshake_timeout_s"),
        ({"handshake_timeout_s": True}, "handshake_timeout_s"),
    ],
)
def test_budget_arguments_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        RegistryServer(MemoryRegistry(), secret=SECRET, **kwargs)
