"""Registry backends: every backend runs the same test bodies (memory, remote over TCP, Redis, and
JAX on an in-process stand-in of the coordination service), plus the wire protocol's security and
robustness, and JaxRegistry across 2 real jax.distributed processes."""

from __future__ import annotations

import contextlib
import json
import os
import random
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
from paths import HELPERS
from registry_servers import FakeCoordinationClient, free_port, start_redis, stop

from tpusync._src.cluster.registry import PrefixRegistry, prefix_of
from tpusync._src.cluster.registry._wire import _holders_from_wire, _holders_to_wire
from tpusync.cluster import (
    Holder,
    JaxRegistry,
    MemoryRegistry,
    NodeInfo,
    RedisRegistry,
    Registry,
    RegistryServer,
    RemoteRegistry,
    longest_common_prefix,
    longest_prefix,
)
from tpusync.errors import (
    AuthenticationError,
    InvalidArgumentError,
    RegistryUnavailableError,
    TpuSyncError,
)

SECRET = b"s" * 32
SHORT_TTL = 0.4  # a lease that lapses (with Redis, in real time)


# -- backends ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A real redis-server on a free port for this session (see :func:`start_redis`)."""
    port = free_port()
    proc = start_redis(port)
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        stop(proc)


BACKENDS = ["memory", "remote", "redis", "jax-fake"]
START = 1_000.0  # the manual clock's first reading


class Backend:
    """Makes registries of one backend (call it); all made in one test share one store (two
    clients of one registry, where the backend has clients).

    Time passes with :meth:`advance` and :meth:`let_lapse`: the backends that take a clock
    (memory, remote over a memory registry, JAX) get a manual one that only moves when told;
    Redis keeps leases on its server's clock, so there they wait for real time, polling."""

    def __init__(self, kind: str, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        self.now = START
        self.closers: list[Callable[[], None]] = []
        self._shared: Any = None
        if kind == "memory":
            self._shared = MemoryRegistry(clock=self.clock)
        elif kind == "remote":
            server = RegistryServer(MemoryRegistry(clock=self.clock), secret=SECRET)
            self.closers.append(server.close)
            self._address = server.address
        elif kind == "redis":
            self._url = request.getfixturevalue("redis_url")
            self._prefix = f"t{uuid.uuid4().hex[:10]}"
        else:
            self._fake = FakeCoordinationClient()

    def clock(self) -> float:
        return self.now

    def __call__(self) -> Any:
        if self.kind == "memory":
            return self._shared
        if self.kind == "remote":
            client: Any = RemoteRegistry(self._address, secret=SECRET)
        elif self.kind == "redis":
            client = RedisRegistry(self._url, prefix=self._prefix)
        else:
            client = JaxRegistry(prefix="test/reg", client=self._fake, clock=self.clock)
        self.closers.append(client.close)
        return client

    def advance(self, seconds: float, *, beat: Callable[[], None] | None = None) -> None:
        """Lets ``seconds`` pass, calling ``beat`` at least every quarter of them (with Redis:
        about every 50 ms of real time)."""
        beat = beat or (lambda: None)
        if self.kind != "redis":
            for _ in range(4):
                self.now += seconds / 4
                beat()
            return
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            beat()
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))
        beat()

    def let_lapse(self, registry: Any, node_ids: list[str]) -> None:
        """Moves time on until the leases of ``node_ids`` (taken for SHORT_TTL) have lapsed: the
        manual clock moves to their very end (a lease holds until ``expiry <= now``); Redis is
        polled (deadline 10 s) until no node of them is listed."""
        if self.kind != "redis":
            self.now += SHORT_TTL
            return
        deadline = time.monotonic() + 10
        while {n.node_id for n in registry.nodes()} & set(node_ids):
            assert time.monotonic() < deadline, f"Redis never expired the leases of {node_ids}"
            time.sleep(0.02)

    def close(self) -> None:
        for close in reversed(self.closers):
            close()


@pytest.fixture(params=BACKENDS)
def make(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """A :class:`Backend` of each kind in turn."""
    backend = Backend(request.param, request)
    try:
        yield backend
    finally:
        backend.close()


@pytest.fixture
def registry(make: Backend) -> Any:
    return make()


def k(i: int, length: int = 16) -> bytes:
    return i.to_bytes(4, "big") * (length // 4) + bytes(length % 4)


def ids(holders: list[list[Holder]]) -> list[list[str]]:
    return [[h.node_id for h in held] for held in holders]


def pairs(holders: list[list[Holder]]) -> list[list[tuple[str, str]]]:
    """Holders with their tiers (Holder's own equality ignores the tier)."""
    return [[(h.node_id, h.tier) for h in held] for held in holders]


def fast_prefix(registry: Any, keys: list[bytes], exclude: str | None = None) -> Any:
    """The backend's own prefix lookup where it has one, else longest_prefix's fallback."""
    if isinstance(registry, PrefixRegistry):
        return registry.prefix_holders(keys, exclude=exclude)
    return longest_prefix(registry, keys, exclude=exclude)[1]


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


def test_publish_withdraw_holders_sorted(make: Backend) -> None:
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


def test_lease_lapse_and_reregister(make: Backend) -> None:
    registry = make()
    registry.register(NodeInfo("short"), SHORT_TTL)
    registry.register(NodeInfo("long"), 30)
    registry.publish("short", [k(1), k(2)], "dram")
    registry.publish("long", [k(1)], "disk")
    assert ids(registry.holders([k(1), k(2)])) == [["long", "short"], ["short"]]
    make.let_lapse(registry, ["short"])
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
    beats: list[bool] = []
    make.advance(0.8, beat=lambda: beats.append(registry.heartbeat("beating", 0.6)))
    assert beats and all(beats), beats
    assert ids(registry.holders([k(5)])) == [["beating"]]


def test_sweep(make: Backend) -> None:
    registry = make()
    registry.register(NodeInfo("a"), SHORT_TTL)
    registry.register(NodeInfo("b"), SHORT_TTL)  # no entries: still a node to sweep
    registry.register(NodeInfo("c"), 30)
    registry.publish("a", [k(1), k(2)], "dram")
    registry.publish("c", [k(2)], "dram")
    assert registry.sweep() == 0
    make.let_lapse(registry, ["a", "b"])
    assert registry.sweep() == 2
    assert registry.sweep() == 0
    assert ids(registry.holders([k(1), k(2)])) == [[], ["c"]]
    # after the sweep "a" is unknown; registering it again starts clean
    assert registry.heartbeat("a", 30) is False
    registry.register(NodeInfo("a"), 30)
    assert ids(registry.holders([k(1), k(2)])) == [[], ["c"]]
    assert sorted(n.node_id for n in registry.nodes()) == ["a", "c"]


def test_longest_prefix_across_shards(make: Backend) -> None:
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
    ("prefix bad key", lambda r: longest_prefix(r, [k(0), 5])),
    ("prefix bad key past a gap", lambda r: longest_prefix(r, [k(0), k(1), b"z" * 33])),
    ("prefix bad exclude", lambda r: longest_prefix(r, [k(0)], exclude=5)),
    ("fast prefix bad key past a gap", lambda r: fast_prefix(r, [k(1), "text"])),
    ("fast prefix bad exclude", lambda r: fast_prefix(r, [k(0)], exclude=b"live")),
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


def test_concurrent_publish_withdraw(make: Backend) -> None:
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


def test_prefix_holders(make: Backend) -> None:
    r1, r2 = make(), make()
    expected_fast = not isinstance(r1, JaxRegistry)
    assert isinstance(r1, PrefixRegistry) is expected_fast
    for name in ("b", "a", "c"):
        r1.register(NodeInfo(name), 30)
    r1.register(NodeInfo("short"), SHORT_TTL)
    keys = [k(i, 24) for i in range(10)]
    r1.publish("a", keys[:6], "dram")
    r2.publish("b", keys[:3], "disk")
    r1.publish("c", [keys[1]], "shm")
    r2.publish("c", keys[7:], "dram")  # after a gap: never part of the prefix
    r1.publish("short", keys[:9], "dram")
    assert pairs(fast_prefix(r2, keys))[:7] == (
        [[("a", "dram"), ("b", "disk"), ("short", "dram")]]
        + [[("a", "dram"), ("b", "disk"), ("c", "shm"), ("short", "dram")]]
        + [[("a", "dram"), ("b", "disk"), ("short", "dram")]]
        + [[("a", "dram"), ("short", "dram")]] * 3
        + [[("short", "dram")]]
    )
    assert len(fast_prefix(r2, keys)) == 10  # short holds 6..8, c 7..9
    assert (
        ids(fast_prefix(r1, keys, exclude="short"))
        == [["a", "b"], ["a", "b", "c"], ["a", "b"]] + [["a"]] * 3
    )
    make.let_lapse(r1, ["short"])  # its entries stop counting at once
    found = fast_prefix(r2, keys)
    assert ids(found) == [["a", "b"], ["a", "b", "c"], ["a", "b"]] + [["a"]] * 3
    assert longest_prefix(r1, keys) == (6, found)
    assert ids(fast_prefix(r1, keys, exclude="a")) == [["b"], ["b", "c"], ["b"]]
    assert fast_prefix(r1, keys, exclude="nobody") == found
    assert fast_prefix(r1, keys[6:]) == []
    assert fast_prefix(r1, []) == []
    assert ids(fast_prefix(r1, keys[7:])) == [["c"]] * 3
    assert longest_common_prefix(r1, [keys, keys[3:]]) == 3
    # the answer is the caller's to change
    found[0].append(Holder("x", "y"))
    assert ids(fast_prefix(r2, keys[:1])) == [["a", "b"]]
    # a lapsed node that registers again holds nothing until it re-publishes
    r1.register(NodeInfo("short"), 30)
    assert len(fast_prefix(r2, keys)) == 6
    r1.publish("short", keys[6:7], "disk")
    assert len(fast_prefix(r2, keys)) == 10
    r1.unregister("c")
    assert len(fast_prefix(r2, keys)) == 7
    r1.withdraw("a", keys[:1])
    r1.withdraw("b", keys[:1])
    assert fast_prefix(r2, keys) == []
    assert r1.holders(keys[:1]) == [[]]


def test_prefix_holders_big(make: Backend) -> None:
    """Lookups of more keys than one request / script call carries (batches; JAX: the thread
    pool's RPCs, one per key, on the fake service, whose directory gets are ranges as on the
    real one)."""
    registry = make()
    registry.register(NodeInfo("n1"), 30)
    registry.register(NodeInfo("n2"), 30)
    keys = [k(i, 20) for i in range(9000)]
    registry.publish("n1", keys[:8500], "dram")
    registry.publish("n2", keys[4000:4001] + keys[8400:8600], "disk")
    assert len(fast_prefix(registry, keys)) == 8600
    assert len(fast_prefix(registry, keys, exclude="n2")) == 8500
    assert len(fast_prefix(registry, keys, exclude="n1")) == 0
    found = registry.holders(keys)
    assert [len(h) for h in found] == [1] * 4000 + [2] + [1] * 4399 + [2] * 100 + [1] * 100 + [
        0
    ] * 400
    assert ids(found[4000:4001]) == [["n1", "n2"]]
    registry.withdraw("n1", keys[1000:1001])
    assert len(fast_prefix(registry, keys)) == 1000
    registry.withdraw("n1", keys[:1])
    assert fast_prefix(registry, keys) == []


class Model:
    """What a registry answers, by definition (for comparing the backends with)."""

    def __init__(self) -> None:
        self.alive: set[str] = set()
        self.lapsed: set[str] = set()
        self.entries: dict[bytes, dict[str, str]] = {}

    def holders(self, keys: list[bytes]) -> list[list[tuple[str, str]]]:
        return [
            sorted((n, t) for n, t in self.entries.get(key, {}).items() if n in self.alive)
            for key in keys
        ]

    def prefix(self, keys: list[bytes], exclude: str | None) -> list[list[tuple[str, str]]]:
        out = []
        for held in self.holders(keys):
            held = [(n, t) for n, t in held if n != exclude]
            if not held:
                break
            out.append(held)
        return out

    def drop(self, node: str) -> None:
        for held in self.entries.values():
            held.pop(node, None)


@pytest.mark.parametrize("seed", [1, 2])
def test_prefix_matches_holders_on_random_histories(make: Backend, seed: int) -> None:
    """Random publish / withdraw / unregister / re-register / sweep histories, with lapsed
    nodes: holders, prefix_holders and longest_prefix all agree with the model (and each
    other) after every step."""
    rng = random.Random(seed)
    r1, r2 = make(), make()
    model = Model()
    names = ["n0", "n1", "n2", "n3", "n4", "n5"]
    pool = [k(i, rng.choice([8, 24, 32])) for i in range(16)]
    short = names[:2]
    for name in names:
        (r1 if name in short else r2).register(NodeInfo(name), SHORT_TTL if name in short else 60)
        model.alive.add(name)
    for name in short:  # give the short-lived ones entries, then let them lapse
        keys = rng.sample(pool, 10)
        r1.publish(name, keys, "dram")
        for key in keys:
            model.entries.setdefault(key, {})[name] = "dram"
    make.let_lapse(r1, short)
    model.alive -= set(short)
    model.lapsed |= set(short)

    def check() -> None:
        for _ in range(3):
            keys = rng.sample(pool, rng.randint(0, len(pool)))
            if rng.random() < 0.5:  # mostly-held sequences, so prefixes get long
                keys.sort(key=lambda key: -len(model.entries.get(key, {})))
            exclude = rng.choice([None, None, *names, "nobody"])
            reader = rng.choice([r1, r2])
            want = model.prefix(keys, exclude)
            assert pairs(reader.holders(keys)) == model.holders(keys)
            assert pairs(fast_prefix(reader, keys, exclude)) == want
            count, found = longest_prefix(reader, keys, exclude=exclude)
            assert (count, pairs(found)) == (len(want), want)
            assert prefix_of(reader.holders(keys), exclude)[0] == count

    check()
    for _ in range(40):
        op = rng.random()
        client = rng.choice([r1, r2])
        name = rng.choice(names)
        keys = rng.sample(pool, rng.randint(1, 8))
        if op < 0.45:
            tier = rng.choice(["dram", "disk", "shm"])
            if name in model.alive:
                client.publish(name, keys, tier)
                for key in keys:
                    model.entries.setdefault(key, {})[name] = tier
            else:
                with pytest.raises(InvalidArgumentError):
                    client.publish(name, keys, tier)
        elif op < 0.75:
            client.withdraw(name, keys)
            for key in keys:
                model.entries.get(key, {}).pop(name, None)
        elif op < 0.85:
            client.unregister(name)
            model.alive.discard(name)
            model.lapsed.discard(name)
            model.drop(name)
        elif op < 0.95:
            if name not in model.alive:  # a new or lapsed node starts clean
                model.drop(name)
            client.register(NodeInfo(name), 60)
            model.alive.add(name)
            model.lapsed.discard(name)
        else:
            assert client.sweep() == len(model.lapsed)
            for gone in model.lapsed:
                model.drop(gone)
            model.lapsed.clear()
        check()


def test_memory_liveness_cache_follows_the_clock() -> None:
    """MemoryRegistry reuses which nodes lapsed between lookups: every change of a lease (and
    the clock passing one) must show at once."""
    now = [100.0]
    registry = MemoryRegistry(clock=lambda: now[0])
    registry.register(NodeInfo("a"), 10)
    registry.register(NodeInfo("b"), 5)
    keys = [k(1), k(2)]
    registry.publish("a", keys, "dram")
    registry.publish("b", keys[:1], "disk")
    assert ids(registry.holders(keys)) == [["a", "b"], ["a"]]
    now[0] = 104.999
    assert ids(registry.prefix_holders(keys)) == [["a", "b"], ["a"]]
    now[0] = 105.0  # b's lease ends
    assert ids(registry.holders(keys)) == [["a"], ["a"]]
    assert ids(registry.prefix_holders(keys, exclude="a")) == []
    assert registry.heartbeat("a", 1) is True  # a's lease is now shorter: until 106
    now[0] = 105.5
    assert ids(registry.prefix_holders(keys)) == [["a"], ["a"]]
    now[0] = 106.0
    assert registry.holders(keys) == [[], []]
    assert registry.prefix_holders(keys) == []
    registry.register(NodeInfo("b"), 10)  # lapsed: starts clean
    assert registry.holders(keys) == [[], []]
    registry.register(NodeInfo("a"), 10)
    registry.publish("a", keys[1:], "shm")
    registry.publish("b", keys, "dram")
    assert pairs(registry.holders(keys)) == [[("b", "dram")], [("a", "shm"), ("b", "dram")]]
    registry.register(NodeInfo("b"), 1)  # a live node's new lease may be shorter
    now[0] = 107.0
    assert pairs(registry.prefix_holders(keys)) == []
    assert pairs(registry.holders(keys)) == [[], [("a", "shm")]]
    now[0] = 50.0  # a clock that goes back (a test's): everything counts again
    assert ids(registry.holders(keys)) == [["b"], ["a", "b"]]
    now[0] = 120.0
    assert registry.sweep() == 2
    assert registry.holders(keys) == [[], []]
    assert registry._entries == {} and registry._holder_objs == {}


def test_memory_holders_are_shared_and_sorted() -> None:
    registry = MemoryRegistry()
    names = [f"n{i:02d}" for i in range(20)]
    for name in random.Random(3).sample(names, len(names)):
        registry.register(NodeInfo(name), 30)
        registry.publish(name, [k(1), k(2)], "dram")
    registry.publish("n07", [k(1)], "disk")  # the same node in another tier: replaced
    found = registry.holders([k(1), k(2)])
    assert ids(found) == [names, names]
    assert found[0][7].tier == "disk" and found[1][7].tier == "dram"
    assert found[0][0] is found[1][0]  # one Holder per node and tier
    registry.withdraw("n10", [k(1)])
    assert ids(registry.holders([k(1)])) == [names[:10] + names[11:]]


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
        sends.clear()  # the script is loaded now: one script call each
        assert registry.holders(keys) == found
        assert len(sends) == 1, f"{len(sends)} round trips for a 512-key lookup"
        sends.clear()
        assert longest_prefix(registry, keys) == (512, found)
        assert len(sends) == 1, f"{len(sends)} round trips for a 512-key prefix"
        sends.clear()
        registry.publish("n2", keys, "shm")
        registry.withdraw("n2", keys)
        assert len(sends) <= 4, f"{len(sends)} round trips for a 512-key publish + withdraw"
    finally:
        registry.close()


def test_redis_reloads_scripts_after_restart(tmp_path: Path) -> None:
    """Redis forgets loaded scripts when it restarts (or on SCRIPT FLUSH): lookups load the
    script again (NOSCRIPT) and answer, single calls and multi-batch pipelines alike."""
    import redis

    from tpusync._src.cluster.registry.redis import _LOOKUP_SHA

    port = free_port()
    proc = start_redis(port)
    url = f"redis://127.0.0.1:{port}/0"
    registry = RedisRegistry(url, prefix="restart", timeout_s=2)
    admin = redis.Redis.from_url(url, socket_timeout=2)
    keys = [k(i, 24) for i in range(2500)]  # 3 script calls for holders

    def fill(tier: str) -> None:
        registry.register(NodeInfo("n"), 30)
        registry.publish("n", keys[:2000], tier)

    try:
        fill("dram")
        assert admin.script_exists(_LOOKUP_SHA) == [False]
        assert len(fast_prefix(registry, keys)) == 2000
        assert admin.script_exists(_LOOKUP_SHA) == [True]
        stop(proc)
        with pytest.raises(RegistryUnavailableError):
            fast_prefix(registry, keys)
        proc = start_redis(port)  # empty, no scripts
        assert admin.script_exists(_LOOKUP_SHA) == [False]
        assert fast_prefix(registry, keys) == []
        assert admin.script_exists(_LOOKUP_SHA) == [True]
        fill("disk")
        assert pairs(fast_prefix(registry, keys[:3])) == [[("n", "disk")]] * 3
        admin.script_flush()
        found = registry.holders(keys)  # a pipeline of script calls gets NOSCRIPT
        assert [len(h) for h in found] == [1] * 2000 + [0] * 500
        admin.script_flush()
        assert len(fast_prefix(registry, keys)) == 2000
        admin.script_flush()
        registry.register(NodeInfo("m"), 30)  # the writing scripts are reloaded too
        registry.publish("m", keys[2000:], "shm")
        assert len(longest_prefix(registry, keys)[1]) == 2500
    finally:
        registry.close()
        admin.close()
        stop(proc)


def test_redis_decoded_client_and_odd_names(redis_url: str) -> None:
    """A passed-in client with decode_responses=True, node ids and tiers with the script's
    separators and non-ASCII characters in them."""
    import redis

    client = redis.Redis.from_url(redis_url, decode_responses=True)
    registry = RedisRegistry(client=client, prefix=f"t{uuid.uuid4().hex[:10]}")
    try:
        names = ["a b,c", "ä 1", "0", "z:\n"]
        for name in names:
            registry.register(NodeInfo(name), 30)
        keys = [k(i, 24) for i in range(4)]
        registry.publish("a b,c", keys, "t 1,2")
        registry.publish("ä 1", keys[1:], "ü")
        registry.publish("0", keys[:1], "1")
        registry.publish("z:\n", keys[2:3], " ")
        want = [
            [("0", "1"), ("a b,c", "t 1,2")],
            [("a b,c", "t 1,2"), ("ä 1", "ü")],
            [("a b,c", "t 1,2"), ("z:\n", " "), ("ä 1", "ü")],
            [("a b,c", "t 1,2"), ("ä 1", "ü")],
        ]
        assert pairs(registry.holders(keys)) == want
        assert pairs(registry.prefix_holders(keys)) == want
        assert pairs(registry.prefix_holders(keys, exclude="a b,c")) == [
            [h for h in held if h[0] != "a b,c"] for held in want
        ]
        assert pairs(registry.prefix_holders(keys, exclude="ä 1")) == [
            [h for h in held if h[0] != "ä 1"] for held in want
        ]
        assert registry.holders([k(9)]) == [[]]
    finally:
        registry.close()
        client.close()


@pytest.mark.parametrize(
    ("environment", "fails"),
    [
        ({"CI": "true"}, True),
        ({"TPUSYNC_REQUIRE_TOOLS": "1"}, True),
        ({"CI": "1", "TPUSYNC_REQUIRE_TOOLS": "0"}, True),
        ({"CI": "0"}, False),
        ({"CI": ""}, False),
        ({}, False),
    ],
    ids=["CI", "REQUIRE_TOOLS", "CI-only", "CI=0", "CI-empty", "local"],
)
def test_missing_redis_server_fails_in_ci(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], fails: bool
) -> None:
    """Without redis-server on PATH the Redis tests fail in CI (naming the program and its apt
    package) and skip only elsewhere: CI cannot hide them."""
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no redis-server on it
    for name in ("CI", "TPUSYNC_REQUIRE_TOOLS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    outcome = pytest.fail.Exception if fails else pytest.skip.Exception
    with pytest.raises(
        outcome, match="redis-server is not installed: apt-get install redis-server"
    ):
        start_redis(free_port())


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
            (b'{"id": 20, "method": "prefix", "params": {"keys": {"hex": "00", "size": 0}}}',
             "InvalidArgument"),
            (b'{"id": 21, "method": "prefix", "params": {"keys": {"hex": "0011", "size": 3}}}',
             "InvalidArgument"),
            (b'{"id": 22, "method": "prefix", "params": {"keys": {"hex": "zz", "size": 1}}}',
             "InvalidArgument"),
            (b'{"id": 23, "method": "prefix", "params": {"keys": {"hex": "00", "size": 33}}}',
             "InvalidArgument"),
            (b'{"id": 24, "method": "prefix", "params": {"keys": {"hex": "00", "size": true}}}',
             "InvalidArgument"),
            (b'{"id": 25, "method": "prefix", "params": {"keys": {"hex": "00", "size": 1, '
             b'"more": 1}}}', "InvalidArgument"),
            (b'{"id": 26, "method": "prefix", "params": {"keys": ["00"], "exclude": 5}}',
             "InvalidArgument"),
            (b'{"id": 27, "method": "prefix", "params": {"keys": [""]}}', "InvalidArgument"),
        ]  # fmt: skip
        for payload, kind in cases:
            send_raw(sock, payload)
            answer = recv(sock)
            assert answer["error"]["type"].startswith(kind), (payload, answer)
        send(sock, {"id": 9, "method": "ping"})
        assert recv(sock) == {"id": 9, "result": "pong"}
        nothing = {"holders": [], "rows": [], "runs": []}
        for keys in ({"hex": "0000" * 3, "size": 2}, ["00", "0102"], {"hex": "", "size": 5}):
            send(sock, {"id": 10, "method": "prefix", "params": {"keys": keys}})
            assert recv(sock) == {"id": 10, "result": nothing}
        send(sock, {"id": 11, "method": "holders", "params": {"keys": ["00"], "compact": True}})
        assert recv(sock) == {"id": 11, "result": {"holders": [], "rows": [[]], "runs": [[0, 1]]}}
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
                         "holders", "prefix", "nodes", "sweep", "close", "__init__", ""]
                    ),
                    "params": st.one_of(
                        st.dictionaries(
                            st.sampled_from(
                                ["node", "node_id", "keys", "tier", "ttl_s", "exclude", "compact"]
                            ),
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


def test_remote_prefix_is_one_request(
    server: RegistryServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = RemoteRegistry(server.address, secret=SECRET, timeout_s=5)
    try:
        client.register(NodeInfo("n"), 30)
        keys = [k(i, 24) for i in range(512)]
        client.publish("n", keys[:300], "dram")
        calls: list[str] = []
        sent: list[dict[str, Any]] = []
        real = client._call

        def counting(method: str, params: dict[str, Any]) -> Any:
            calls.append(method)
            sent.append(params)
            return real(method, params)

        monkeypatch.setattr(client, "_call", counting)
        count, found = longest_prefix(client, keys)
        assert count == 300 and pairs(found) == [[("n", "dram")]] * 300
        assert calls == ["prefix"]
        calls.clear()
        assert longest_common_prefix(client, [keys, keys[:200]]) == 200
        assert calls == ["prefix", "prefix"]
        assert sent[0]["keys"] == {"hex": b"".join(keys).hex(), "size": 24}  # packed
        client.publish("n", [k(1, 8)], "dram")
        sent.clear()
        assert longest_prefix(client, [*keys[:2], k(1, 8)])[0] == 3
        assert sent[0]["keys"] == [keys[0].hex(), keys[1].hex(), k(1, 8).hex()]  # sizes differ
    finally:
        client.close()


class ProtocolOnly:
    """A Registry with nothing but the protocol's methods (no prefix_holders)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        for name in ("register", "heartbeat", "unregister", "publish", "withdraw", "holders",
                     "nodes", "close"):  # fmt: skip
            setattr(self, name, getattr(inner, name))


def test_remote_prefix_against_other_servers() -> None:
    """A server whose registry has no prefix_holders falls back to holders; a client of a
    server that predates "prefix" (or the compact holders answer) falls back too."""
    inner = MemoryRegistry()
    plain = ProtocolOnly(inner)
    assert isinstance(plain, Registry) and not isinstance(plain, PrefixRegistry)
    keys = [k(i, 24) for i in range(6)]
    with (
        RegistryServer(plain, secret=SECRET) as srv,
        RemoteRegistry(srv.address, secret=SECRET, timeout_s=5) as client,
    ):
        client.register(NodeInfo("a"), 30)
        client.register(NodeInfo("b"), 30)
        client.publish("a", keys[:4], "dram")
        client.publish("b", keys[1:5], "disk")
        want = [[("a", "dram")]] + [[("a", "dram"), ("b", "disk")]] * 3 + [[("b", "disk")]]
        assert pairs(client.prefix_holders(keys)) == want
        assert pairs(client.prefix_holders(keys, exclude="b")) == [[("a", "dram")]] * 4
        # an old server: no "prefix", holders in the plain form
        old_holders = lambda p: [  # noqa: E731
            [[h.node_id, h.tier] for h in held]
            for held in plain.holders([bytes.fromhex(x) for x in p["keys"]])
        ]
        srv._methods["holders"] = old_holders
        del srv._methods["prefix"]
        assert pairs(client.holders(keys)) == [*want, []]
        assert pairs(client.prefix_holders(keys)) == want
        assert client._no_prefix
        assert client.prefix_holders(keys, exclude="a") == []  # only a holds keys[0]
        assert pairs(client.prefix_holders(keys[1:], exclude="a")) == [[("b", "disk")]] * 4
        assert longest_prefix(client, keys, exclude="b")[0] == 4
        with pytest.raises(InvalidArgumentError):
            client.prefix_holders([k(1), b""])


@settings(max_examples=200, deadline=None)
@given(
    found=st.lists(
        st.lists(
            st.sampled_from(
                [Holder("a", "dram"), Holder("a", "disk"), Holder("b", "dram"), Holder("c", "x")]
            ),
            max_size=3,
        ),
        max_size=12,
    )
)
def test_compact_wire_form_round_trips(found: list[list[Holder]]) -> None:
    found = [sorted({h.node_id: h for h in held}.values()) for held in found]  # one per node
    wire = json.loads(json.dumps(_holders_to_wire(found)))
    back = _holders_from_wire(wire, "test")
    assert pairs(back) == pairs(found)
    assert sum(count for _, count in wire["runs"]) == len(found)
    assert len(wire["holders"]) <= 4
    assert pairs(
        _holders_from_wire([[[h.node_id, h.tier] for h in held] for held in found], "t")
    ) == (pairs(found))
    with pytest.raises(RegistryUnavailableError, match="malformed"):
        _holders_from_wire({"holders": [], "rows": [[0]], "runs": [[0, 1]]}, "test")


def test_remote_reconnects_once_and_times_out(server: RegistryServer) -> None:
    client = RemoteRegistry(server.address, secret=SECRET, timeout_s=5)
    client.register(NodeInfo("n"), 30)
    assert client._conn.sock is not None
    client._conn.sock.shutdown(socket.SHUT_RDWR)  # the connection breaks under the client
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

    # the test process never initializes jax.distributed (its children do): were that to
    # change, this must fail rather than skip
    assert global_state.client is None, "jax.distributed is initialized in the test process"
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
                    [sys.executable, str(HELPERS / "registry_jax_child.py"), str(i), str(port)],
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
