"""Faults in the cluster layer, with real processes: real sockets, real SIGKILL, a real
redis-server restarted empty.

* the source of a pull is killed mid-transfer (a block half sent): the reader gets a result
  or an error at once, commits nothing that was in flight, and a store reading through a
  ``RemotePool`` or a ``RegistryPool`` reports a partial hit and stays usable;
* the reader is killed mid-pull: its lease keeps the blocks pinned until the TTL, then the
  server's expiry thread unpins them with no call from anyone;
* redis-server restarts without persistence: every owner registers again and re-publishes what
  it holds, lookups recover within a bounded time, and no lookup ever names a holder for a block
  it does not hold.

Children (``tests/helpers/cluster_fault_child.py``) are started per test, waited for line by line
with deadlines, and stopped by pid (SIGKILL, then reaped) whatever happens.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import pytest
from cluster_fault_child import payload_for
from paths import HELPERS
from tools import require_tool

from tpusync import DevicePool
from tpusync._src.cluster import serving
from tpusync._src.testing.polling import eventually
from tpusync.cluster import (
    BlockClient,
    BlockServer,
    MemoryRegistry,
    NodeInfo,
    RedisRegistry,
    RegistryPool,
    RegistryServer,
    RemotePool,
)
from tpusync.errors import PeerUnavailableError
from tpusync.kv import DramTier, ExistingTier, KVCacheStore, KVStoreConfig
from tpusync.tiers import ArrayLayout, HostPool, PoolLayout

CHILD = HELPERS / "cluster_fault_child.py"
SECRET = bytes(range(1, 33))
SEED = 20240611  # the blocks' bytes (payload_for) and every token list
STEP_S = 30.0  # the longest wait for one step of a child (start-up included)
PROMPT_S = 5.0  # a pull whose source died must end this soon after the kill
CLIENT_TIMEOUT_S = 20.0  # the reader's socket timeout: a prompt end is not this timing out
BLOCK = 16  # tokens per block

# 256 KiB blocks: two float32 arrays of (16 tokens, 8 heads, 256) per block.
POOL_SHAPE = (BLOCK, 8, 256)
LAYOUT = PoolLayout(
    "faults-raw",
    (
        ArrayLayout("k", "float32", POOL_SHAPE, 0, 1),
        ArrayLayout("v", "float32", POOL_SHAPE, 0, 1),
    ),
)


# -- children --------------------------------------------------------------------------------


class Child:
    """A cluster_fault_child process. Its stdout is read on a thread into a queue, so every
    wait has a deadline; :meth:`stop` kills it by pid and reaps it."""

    def __init__(self, spec: dict[str, Any], workdir: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        spec_path = workdir / f"fault-spec-{tag}.json"
        spec_path.write_text(json.dumps(spec))
        self.stderr_path = workdir / f"fault-child-{tag}.stderr"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(CHILD), str(spec_path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, "JAX_PLATFORMS": "cpu"},
            )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.strip())
        self._lines.put(None)

    def expect(self, prefix: str, timeout: float = STEP_S) -> str:
        """Waits for the child's next line starting with ``prefix`` (others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                line = self._lines.get(timeout=max(left, 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"the child did not say {prefix!r} within {timeout} s"
                ) from None
            if line is None:
                self.proc.wait(timeout=10)
                raise AssertionError(
                    f"the child exited ({self.proc.returncode}) before saying {prefix!r}:\n"
                    + self.stderr_path.read_text()[-4000:]
                )
            if line.startswith(prefix):
                return line

    def send(self, obj: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> float:
        """SIGKILLs the child by pid and reaps it; returns when it was killed (monotonic)."""
        killed = time.monotonic()
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        assert self.proc.returncode == -signal.SIGKILL
        return killed

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                pipe.close()  # type: ignore[union-attr]
        self._reader.join(timeout=10)


@contextlib.contextmanager
def child_process(spec: dict[str, Any], workdir: Path) -> Iterator[Child]:
    child = Child(spec, workdir)
    try:
        yield child
    finally:
        child.stop()


def serve_spec(layout: PoolLayout, capacity: int, **extra: Any) -> dict[str, Any]:
    return {
        "mode": "serve",
        "layout": layout.describe(),
        "capacity": capacity,
        "secret_hex": SECRET.hex(),
        "seed": SEED,
        **extra,
    }


# -- helpers ---------------------------------------------------------------------------------


def payload(pool: HostPool, key: bytes) -> bytes:
    slot = pool.slot_of(key)
    assert slot is not None, f"{key.hex()} is not committed"
    with pool.slot_memory(slot) as memory:
        return bytes(memory[: pool.layout.payload_bytes])


def assert_holds_only_verified(pool: HostPool, expected: dict[bytes, bytes], count: int) -> None:
    """``pool`` holds exactly ``count`` committed blocks, no slot is left half written, and every
    block it holds is one of ``expected``'s, byte for byte and against its recorded checksum."""
    assert pool.used == count and pool.free == pool.capacity - count
    held = pool.keys()
    assert len(held) == count
    pinned = pool.pin(held)
    try:
        assert (pool.hash_slots(pinned.slots) == pinned.checksums).all()
    finally:
        pool.unpin(pinned)
    for key in held:
        assert key in expected, f"{key.hex()}: a block nobody sent"
        assert payload(pool, key) == expected[key], f"{key.hex()}: wrong bytes"


def device_payloads(pools: list[DevicePool], keys: list[bytes], ids: list[int]) -> list[bytes]:
    """The bytes the device blocks ``ids`` hold, in slot format (copied out through a pool)."""
    layout = PoolLayout.from_pools("check", pools)
    with HostPool(layout, max(len(keys), 1)) as check:
        check.put_from_device(keys, pools, ids)
        return [payload(check, key) for key in keys]


def device_pools(num_blocks: int) -> list[DevicePool]:
    return [DevicePool(jnp.zeros((num_blocks, *POOL_SHAPE), jnp.float32)) for _ in range(2)]


def tokens_for(n_blocks: int, salt: int = 0) -> np.ndarray:
    rng = np.random.default_rng([SEED, salt])
    return rng.integers(0, 50_000, n_blocks * BLOCK).astype(np.int32)


# -- 1. the source dies mid-transfer ---------------------------------------------------------

N_BLOCKS = 64
WARM = 8  # blocks the reader already holds (pulled before the faulty pull)
HOLD_AFTER = WARM + 12  # the child sends this many blocks, then half of one, then stops


def test_source_killed_mid_pull_commits_nothing_in_flight(tmp_path: Path) -> None:
    """A BlockClient pulls 64 blocks of 256 KiB over 2 connections from a child that sends 12
    of them and half of the next and is then SIGKILLed. The pull ends within seconds (not at
    its 20 s socket timeout) with an error and no block it was receiving; the 8 blocks it held
    before stay, bit-exact; a half-written slot is never committed, none stays reserved; the
    next pull fails at once with PeerUnavailableError."""
    keys = [b"fault-" + i.to_bytes(4, "little") for i in range(N_BLOCKS)]
    expected = {k: payload_for(SEED, i, LAYOUT.payload_bytes) for i, k in enumerate(keys)}
    spec = serve_spec(LAYOUT, N_BLOCKS, hold_after=HOLD_AFTER)
    with child_process(spec, tmp_path) as child, HostPool(LAYOUT, N_BLOCKS) as target:
        address = child.expect("ready").split()[1]
        child.send([k.hex() for k in keys])
        child.expect("filled")
        with BlockClient(
            address, secret=SECRET, connections=2, timeout_s=CLIENT_TIMEOUT_S
        ) as client:
            assert client.pull(keys[:WARM], target) == [True] * WARM
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pulling = pool.submit(client.pull_result, keys, target)
                child.expect("holding")
                assert not pulling.done()  # in flight: 12 blocks and a half are out
                killed = child.kill()
                result = pulling.result(timeout=CLIENT_TIMEOUT_S + 10)
                ended = time.monotonic() - killed
            assert ended < PROMPT_S, f"the pull took {ended:.1f} s to notice its source died"
            assert result.loaded == [True] * WARM + [False] * (N_BLOCKS - WARM)
            assert result.error is not None and not result.released
            assert result.bytes_received >= 12 * LAYOUT.payload_bytes  # they did arrive
            assert_holds_only_verified(target, expected, WARM)
            # The source is gone: the next pull says so at once, and moves nothing.
            start = time.monotonic()
            with pytest.raises(PeerUnavailableError):
                client.pull(keys, target)
            assert time.monotonic() - start < PROMPT_S
            assert_holds_only_verified(target, expected, WARM)


class StoreOverChild:
    """A KVCacheStore whose lower tier reads a child's DRAM: through a RemotePool
    (``remote``) or a RegistryPool that finds the child in a registry (``cluster``; the child
    publishes its keys under a 1 s node lease, as ``publish_to`` does)."""

    REGISTRY_TTL_S = 1.0

    def __init__(self, stack: contextlib.ExitStack, tier: str, workdir: Path, **spec: Any):
        self.tier = tier
        model = f"faults-{tier}"
        self.pools = device_pools(N_BLOCKS)
        layout = PoolLayout.from_pools(model, self.pools)
        self.registry = MemoryRegistry()
        extra: dict[str, Any] = {}
        if tier == "cluster":
            server = stack.enter_context(RegistryServer(self.registry, secret=SECRET))
            extra["registry"] = {
                "address": server.address,
                "node_id": "source",
                "ttl_s": self.REGISTRY_TTL_S,
            }
        self.child = stack.enter_context(
            child_process(serve_spec(layout, N_BLOCKS, **spec, **extra), workdir)
        )
        address = self.child.expect("ready").split()[1]
        lower: Any
        if tier == "remote":
            client = BlockClient(address, secret=SECRET, connections=2, timeout_s=CLIENT_TIMEOUT_S)
            lower = stack.enter_context(RemotePool(client, layout))
        else:
            lower = RegistryPool(
                self.registry,
                layout,
                secret=SECRET,
                exclude="decode",
                connections=2,
                timeout_s=CLIENT_TIMEOUT_S,
            )
            stack.callback(lower.close)
        config = KVStoreConfig(
            model, BLOCK, DramTier(N_BLOCKS + 8), tiers=(ExistingTier(tier, lower),)
        )
        self.store = stack.enter_context(KVCacheStore(config, self.pools))
        assert self.store.layout == layout
        self.tokens = tokens_for(N_BLOCKS)
        self.keys = self.keys_of(self.tokens)
        self.expected = {
            k: payload_for(SEED, i, layout.payload_bytes) for i, k in enumerate(self.keys)
        }
        self.child.send([k.hex() for k in self.keys])
        self.child.expect("filled")
        if tier == "cluster":
            self.child.expect("published")

    def keys_of(self, tokens: np.ndarray) -> list[bytes]:
        return self.store.scheme.block_keys(self.store.namespace, tokens, BLOCK)


@pytest.mark.parametrize("tier", ["remote", "cluster"])
def test_store_loading_from_a_killed_source_reports_a_partial_hit(
    tmp_path: Path, tier: str
) -> None:
    """A KVCacheStore reads a child's DRAM through a RemotePool (``remote``) or through a
    RegistryPool that found the child in a registry (``cluster``). The store already holds the
    first 8 blocks of a 64-block prompt; loading the prompt pulls the other 56, and the child is
    SIGKILLed with 12 sent and one half sent. The load returns at once with the 8 local blocks
    (a partial hit: the caller recomputes from there), DRAM holds exactly those 8, bit-exact,
    and so do their device blocks; with the registry, the dead node stops being listed within
    its TTL and lookups then find only the local prefix."""
    with contextlib.ExitStack() as stack:
        env = StoreOverChild(stack, tier, tmp_path, hold_after=HOLD_AFTER)
        store, child, tokens, keys = env.store, env.child, env.tokens, env.keys

        # The first 8 blocks come over first, whole (they are the store's from now on).
        hit = store.lookup(tokens[: WARM * BLOCK])
        assert hit.tiers == (tier,) * WARM
        assert store.load(hit, list(range(WARM))).loaded_blocks == WARM
        hit = store.lookup(tokens)
        assert hit.tiers == ("dram",) * WARM + (tier,) * (N_BLOCKS - WARM)

        # The child sends 12 more and half of one, and stops; then it is killed.
        loading = store.load_async(hit, list(range(N_BLOCKS)))
        child.expect("holding")
        assert not loading.done()
        killed = child.kill()
        loaded = loading.result(timeout=CLIENT_TIMEOUT_S + 10)
        ended = time.monotonic() - killed
        assert ended < PROMPT_S, f"the load took {ended:.1f} s to notice its source died"
        assert loaded.loaded_blocks == WARM and loaded.loaded_tokens == WARM * BLOCK
        assert loaded.requested_blocks == N_BLOCKS
        assert_holds_only_verified(store.dram, env.expected, WARM)
        assert set(store.dram.keys()) == set(keys[:WARM])
        assert device_payloads(env.pools, keys[:WARM], list(range(WARM))) == [
            env.expected[k] for k in keys[:WARM]
        ]
        stats = store.stats()
        assert stats["store"]["load_misses"] == N_BLOCKS - WARM
        assert stats["store"]["open_handles"] == 0

        if tier == "cluster":
            # Listed until its lease lapses: a load meanwhile is still the partial hit.
            hit = store.lookup(tokens)
            assert hit.num_blocks in (WARM, N_BLOCKS)
            assert store.load(hit, list(range(hit.num_blocks))).loaded_blocks == WARM
            eventually(
                lambda: not any(env.registry.holders(keys)),
                env.REGISTRY_TTL_S + 3,
                "the dead node is still listed",
            )
            with store.lookup(tokens) as again:
                assert again.tiers == ("dram",) * WARM


@pytest.mark.parametrize("tier", ["remote", "cluster"])
def test_store_stays_usable_after_its_source_died(tmp_path: Path, tier: str) -> None:
    """The child dies between a lookup (which found 8 blocks in it) and their load. Then the
    load is a miss (0 blocks: the caller recomputes), a new lookup of that prompt is a miss,
    and the store still saves, looks up and loads prompts of its own. Every problem is
    collected and reported together."""
    problems: list[str] = []
    with contextlib.ExitStack() as stack:
        env = StoreOverChild(stack, tier, tmp_path, hold_after=None)
        store, tokens = env.store, env.tokens
        prefix = tokens[: WARM * BLOCK]
        hit = store.lookup(prefix)
        assert hit.tiers == (tier,) * WARM
        env.child.kill()

        try:
            loaded = store.load(hit, list(range(WARM))).loaded_blocks
            if loaded != 0:
                problems.append(f"load after the source died: {loaded} blocks loaded, not 0")
        except Exception as error:
            problems.append(f"load after the source died raised {error!r}")
            store.release(hit)  # a failed load leaves the handle open
        try:
            again = store.lookup(prefix)
            if again.num_blocks:  # the registry may list the dead node until its TTL
                n = store.load(again, list(range(again.num_blocks))).loaded_blocks
                if n != 0:
                    problems.append(f"a second load loaded {n} blocks from a dead source")
            else:
                store.release(again)
        except Exception as error:
            problems.append(f"lookup after the source died raised {error!r}")
        own = tokens_for(4, salt=1)
        try:
            stored = store.save(own, [40, 41, 42, 43]).stored_blocks
            if stored != 4:
                problems.append(f"a save after the source died stored {stored} of 4 blocks")
        except Exception as error:
            problems.append(f"a save after the source died raised {error!r}")
        try:
            mine = store.lookup(own)
            n = store.load(mine, [50, 51, 52, 53]).loaded_blocks
            if n != 4:
                problems.append(f"the store's own prompt: {n} of 4 blocks loaded")
        except Exception as error:
            problems.append(f"the store's own prompt: lookup or load raised {error!r}")
        stats = store.stats()
        if stats["store"]["open_handles"]:
            problems.append(f"{stats['store']['open_handles']} handles left open")
    assert not problems, f"with a {tier!r} tier whose source died:\n  " + "\n  ".join(problems)


# -- 2. the reader dies mid-pull -------------------------------------------------------------

LEASE_TTL_S = 4.0
READER_BLOCKS = 32
READER_SENT = 8  # blocks sent before the reader is killed


class GatedServer(BlockServer):
    """Records the leases it grants and the get requests in progress; after READER_SENT blocks
    every sender waits at a gate (so the pull cannot finish or run out of time)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.granted: list[tuple[int, float, float]] = []  # (lease id, when, ttl)
        self.sent = 0
        self.active_gets = 0
        self.reached = threading.Event()
        self.gate = threading.Event()
        self._count = threading.Lock()
        super().__init__(*args, **kwargs)

    # (The hooks take whatever the data plane passes them: only the answer matters here.)
    def _acquire(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        before = time.monotonic()  # the lease's clock starts after this
        answer: dict[str, Any] = super()._acquire(*args, **kwargs)
        self.granted.append((answer["lease"], before, answer["ttl_s"]))
        return answer

    def _handle_get(self, *args: Any, **kwargs: Any) -> bool:
        with self._count:
            self.active_gets += 1
        try:
            return bool(super()._handle_get(*args, **kwargs))
        finally:  # after the handler's own unpin
            with self._count:
                self.active_gets -= 1

    def _send_block(self, conn: socket.socket, header: bytes, data: memoryview) -> None:
        with self._count:
            self.sent += 1
            wait = self.sent > READER_SENT
        if wait:
            self.reached.set()
            self.gate.wait(STEP_S)
        super()._send_block(conn, header, data)


def test_killed_reader_keeps_its_blocks_pinned_until_the_lease_lapses(
    tmp_path: Path, arrays: Any
) -> None:
    """A KVCacheStore serves its DRAM with a 4 s lease TTL; a child takes a lease on 32 blocks
    and is SIGKILLed 8 blocks into its pull. While the lease runs, the server's lease table
    lists it and the store cannot evict (nor the pool delete) any of the 32 blocks -- also
    after the server's sending thread has ended. Then, with no call from the reader or to the
    lease table, the expiry thread drops the lease at its TTL and the blocks become evictable."""
    rng = np.random.default_rng(SEED)
    pools = [
        DevicePool(jnp.asarray(arrays.random(rng, (READER_BLOCKS, *POOL_SHAPE), np.float32)))
        for _ in range(2)
    ]
    config = KVStoreConfig("faults-reader", BLOCK, DramTier(READER_BLOCKS))
    tokens = tokens_for(READER_BLOCKS, salt=2)
    with contextlib.ExitStack() as stack:
        store = stack.enter_context(KVCacheStore(config, pools))
        assert store.save(tokens, list(range(READER_BLOCKS))).stored_blocks == READER_BLOCKS
        keys = store.scheme.block_keys(store.namespace, tokens, BLOCK)
        server = stack.enter_context(
            GatedServer(store.dram, secret=SECRET, lease_ttl_s=LEASE_TTL_S)
        )
        stack.callback(server.gate.set)  # never leave a sender waiting
        spec = {
            "mode": "pull",
            "address": server.address,
            "secret_hex": SECRET.hex(),
            "layout": store.layout.describe(),
            "keys": [k.hex() for k in keys],
            "connections": 2,
        }
        child = stack.enter_context(child_process(spec, tmp_path))
        child.expect("connected")
        assert server.reached.wait(STEP_S), "the reader never got 8 blocks"
        ((lease_id, granted_at, ttl),) = server.granted
        assert ttl == LEASE_TTL_S
        lease = server.leases.lookup(lease_id)
        assert lease is not None and lease.present == [True] * READER_BLOCKS
        assert store.evict(tokens) == 0  # leased: nothing leaves DRAM
        assert store.dram.delete(keys) == 0

        child.kill()
        server.gate.set()  # the senders go on, into a dead socket, and stop
        eventually(lambda: server.active_gets == 0, STEP_S, "the server still sends")
        # Only the lease pins the blocks now; it has not lapsed yet.
        checked = time.monotonic()
        assert checked < granted_at + ttl - 1.0, "too slow to check within the lease"
        assert server.leases.lookup(lease_id) is not None
        assert store.evict(tokens) == 0
        assert store.dram.delete(keys) == 0
        assert store.dram.used == READER_BLOCKS

        # No more calls: the expiry thread alone ends the lease, at its TTL and not before.
        eventually(lambda: server.leases.expired == 1, ttl + 5.0, "the lease never expired")
        assert time.monotonic() >= granted_at + ttl
        assert len(server.leases) == 0
        assert not server.leases.release(lease_id)  # a late release learns it lapsed
        assert store.evict(tokens) == READER_BLOCKS
        assert store.dram.used == 0


# -- 3. redis-server restarts empty ----------------------------------------------------------

REDIS_TTL_S = 1.5  # node lease; the heartbeat runs every third of it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisProcess:
    """A redis-server without persistence on a fixed port, killed and started again by pid."""

    def __init__(self, binary: str, port: int) -> None:
        self.binary, self.port = binary, port
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        assert self.proc is None
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        try:
            deadline = time.monotonic() + STEP_S
            while True:
                try:
                    client.ping()
                    return
                except redis.exceptions.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError(f"redis-server did not start on {self.port}") from None
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
            self.proc = None


@pytest.fixture
def redis_process() -> Iterator[RedisProcess]:
    binary = require_tool("redis-server", "redis-server")  # fails in CI where missing
    server = RedisProcess(binary, free_port())
    server.start()
    try:
        yield server
    finally:
        server.kill()


class CountingRedisRegistry(RedisRegistry):
    """Counts the calls a RegistryLink makes (a link must not spin on a failing registry)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls = 0

    def register(self, *args: Any) -> None:
        self.calls += 1
        super().register(*args)

    def heartbeat(self, *args: Any) -> bool:
        self.calls += 1
        return super().heartbeat(*args)

    def publish(self, *args: Any) -> None:
        self.calls += 1
        super().publish(*args)

    def withdraw(self, *args: Any) -> None:
        self.calls += 1
        super().withdraw(*args)


class Watcher:
    """Asks the registry for the holders of ``keys``, over and over, on its own thread, and
    records every answer that names a holder it must not: a node that held the key neither
    when the question was sent nor when the answer came back, or a tier other than DRAM."""

    def __init__(
        self,
        url: str,
        prefix: str,
        keys: list[bytes],
        owners: Callable[[], dict[bytes, str | None]],
    ) -> None:
        self.registry = RedisRegistry(url, prefix=prefix, timeout_s=0.5)
        self.keys = keys
        self.owners = owners
        self.wrong: list[str] = []
        self.answers = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.registry.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            before = self.owners()
            try:
                found = self.registry.holders(self.keys)
            except Exception:  # the registry is down: no answer, so nothing wrong
                self.failures += 1
                self._stop.wait(0.02)
                continue
            after = self.owners()
            self.answers += 1
            for key, holders in zip(self.keys, found, strict=True):
                for holder in holders:
                    if holder.tier != "dram" or holder.node_id not in (before[key], after[key]):
                        self.wrong.append(f"{key.hex()}: {holder}, held by {after[key]}")
            self._stop.wait(0.005)


def test_redis_restarted_empty_owners_register_again(
    redis_process: RedisProcess, arrays: Any
) -> None:
    """Two stores publish their DRAM keys to a RedisRegistry (1.5 s node lease); a third one
    reads through a RegistryPool. redis-server is SIGKILLed and started again, empty, on the
    same port. While it is down, node A saves one prompt and evicts another (its changes fail
    and wait; its link retries at heartbeats, it does not spin). Once it is back, both owners
    find their lease gone and publish what they hold now, within a heartbeat or two. All along,
    a watcher asks for the holders of every key and never gets a holder that does not hold the
    block; afterwards the reader pulls the prompt A saved during the outage, bit-exact."""
    rng = np.random.default_rng(SEED)
    prefix = f"faults{uuid.uuid4().hex[:8]}"
    num = 24

    def make_store(name: str, extra: tuple[tuple[str, Any], ...] = ()) -> KVCacheStore:
        pools = [
            DevicePool(jnp.asarray(arrays.random(rng, (num, BLOCK, 2, 16), np.float32)))
            for _ in range(2)
        ]
        return KVCacheStore(
            KVStoreConfig(
                "faults-redis",
                BLOCK,
                DramTier(num),
                tiers=tuple(ExistingTier(n, t) for n, t in extra),
            ),
            pools,
        )

    p1, p2, p4, p5, never = (tokens_for(4, salt=10 + i) for i in range(5))
    with contextlib.ExitStack() as stack:
        # The registries close last: the stores' links use them until the stores close.
        reg_a = CountingRedisRegistry(redis_process.url, prefix=prefix, timeout_s=1.0)
        reg_c = CountingRedisRegistry(redis_process.url, prefix=prefix, timeout_s=1.0)
        reg_b = RedisRegistry(redis_process.url, prefix=prefix, timeout_s=1.0)
        for registry in (reg_a, reg_c, reg_b):
            stack.callback(registry.close)
        a = stack.enter_context(make_store("a"))
        c = stack.enter_context(make_store("c"))
        server = stack.enter_context(BlockServer(a.dram, secret=SECRET))
        cluster = RegistryPool(reg_b, a.layout, secret=SECRET, exclude="node-b", timeout_s=5)
        stack.callback(cluster.close)
        b = stack.enter_context(make_store("b", (("cluster", cluster),)))

        def keys_of(tokens: np.ndarray) -> list[bytes]:
            return a.scheme.block_keys(a.namespace, tokens, BLOCK)

        a.save(p1, [0, 1, 2, 3])
        a.save(p2, [4, 5, 6, 7])
        c.save(p5, [0, 1, 2, 3])
        serving.publish_to(
            a, reg_a, NodeInfo("node-a", addresses=(server.address,)), ttl_s=REDIS_TTL_S
        )
        serving.publish_to(c, reg_c, NodeInfo("node-c"), ttl_s=REDIS_TTL_S)
        all_keys = [k for p in (p1, p2, p4, p5, never) for k in keys_of(p)]

        def owners() -> dict[bytes, str | None]:
            in_a, in_c = a.dram.contains(all_keys), c.dram.contains(all_keys)
            return {
                k: "node-a" if x else "node-c" if y else None
                for k, x, y in zip(all_keys, in_a, in_c, strict=True)
            }

        def listed() -> dict[bytes, list[str]]:
            return {
                k: [h.node_id for h in held]
                for k, held in zip(all_keys, reg_b.holders(all_keys), strict=True)
            }

        def settled() -> bool:
            try:
                now = listed()
            except Exception:
                return False
            held = owners()
            return all(now[k] == ([o] if (o := held[k]) else []) for k in all_keys)

        eventually(settled, 5.0, "the first publish")
        with Watcher(redis_process.url, prefix, all_keys, owners) as watcher:
            eventually(lambda: watcher.answers > 5, 5.0, "the watcher's first answers")

            redis_process.kill()
            down = time.monotonic()
            calls_before = reg_a.calls
            # Changes while the registry is away: they wait in A's link.
            assert a.save(p4, [8, 9, 10, 11]).stored_blocks == 4
            assert a.evict(p2) == 4
            assert not a.dram.contains(keys_of(p2))[0]
            # The outage lasts one TTL on purpose (not to wait for anything): a few heartbeats
            # fail meanwhile, and the bound on A's registry calls below is over that span. Redis
            # expires keys on its own clock, so there is no clock to inject.
            time.sleep(REDIS_TTL_S)
            eventually(lambda: watcher.failures > 0, 5.0, "the watcher never saw the outage")
            outage_calls = reg_a.calls - calls_before
            # A heartbeat every 0.5 s and a try per change: a handful of calls, not a spin.
            assert outage_calls <= 20, f"{outage_calls} registry calls in a 1.5 s outage"

            redis_process.start()  # empty: no node, no block
            restarted = time.monotonic()
            took = eventually(settled, 2 * REDIS_TTL_S + 2.0, "the owners never re-published")
            assert watcher.failures > 0  # the watcher did see the outage

            # p4 was saved during the outage: found through the registry, pulled, exact.
            hit = b.lookup(p4)
            assert hit.tiers == ("cluster",) * 4
            assert b.load(hit, [0, 1, 2, 3]).loaded_blocks == 4
            for key in keys_of(p4):
                assert payload(b.dram, key) == payload(a.dram, key)
            with b.lookup(p2) as gone, b.lookup(never) as nothing:
                assert gone.num_blocks == 0 and nothing.num_blocks == 0
            answers_after = watcher.answers
            eventually(lambda: watcher.answers > answers_after + 5, 5.0, "the watcher stalled")
        assert watcher.wrong == [], watcher.wrong[:10]
    print(f"outage {restarted - down:.2f} s, recovered {took:.2f} s after the restart")
