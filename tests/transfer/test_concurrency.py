"""Many transfers in flight from several threads, mixed directions and engines, into pools of
their own and pools they share: every byte lands where it should, and nothing deadlocks (every
wait has a timeout)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tpusync import DevicePool, HostBuffer, Transfer, transfer, transfer_batch

TIMEOUT = 60.0
PATHS = ("native", "jax")
BLOCK = (4, 8)
DTYPE = np.dtype(ml_dtypes.bfloat16)


def put(x: np.ndarray, target: Any = None) -> jax.Array:
    return jax.device_put(np.array(x, copy=True), target or jax.devices()[0])


def run_threads(n: int, body: Callable[[int], None], timeout: float = 120.0) -> None:
    """Runs body(i) on n threads; re-raises the first error; fails on a hang."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def main(i: int) -> None:
        try:
            barrier.wait(TIMEOUT)
            body(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=main, args=(i,), name=f"test-{i}") for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {timeout} s (deadlock?): {alive}"
    if errors:
        raise errors[0]


@dataclass
class Worker:
    """One thread's view: its own pool, its own blocks of the shared pool, numpy mirrors of
    both, and the transfers it has in flight (which never touch the same block twice)."""

    arrays: Any
    rng: np.random.Generator
    own: DevicePool
    own_bits: np.ndarray
    shared: DevicePool
    shared_blocks: np.ndarray  # this worker's blocks of the shared pool
    shared_bits: np.ndarray  # mirror of those blocks, in shared_blocks order
    inflight: list[tuple[Any, Callable[[], None]]] = field(default_factory=list)
    reads: set[tuple[int, int]] = field(default_factory=set)
    writes: set[tuple[int, int]] = field(default_factory=set)
    done: int = 0

    def flush(self) -> None:
        for future, check in self.inflight:
            future.result(TIMEOUT)
            check()
            self.done += 1
        self.inflight.clear()
        self.reads.clear()
        self.writes.clear()

    def submit(
        self,
        make: Callable[[], Any],
        reads: set,
        writes: set,
        check: Callable[[], None] = lambda: None,
    ) -> None:
        if writes & (self.reads | self.writes) or reads & self.writes or len(self.inflight) > 6:
            self.flush()
        self.inflight.append((make(), check))
        self.reads |= reads
        self.writes |= writes

    def pick(self, n: int, k: int) -> np.ndarray:
        return self.rng.choice(n, k, replace=False)

    def step(self) -> None:
        rng, ar = self.rng, self.arrays
        path = str(rng.choice(PATHS))
        k = int(rng.integers(1, 4))
        n_own = self.own_bits.shape[0]
        n_mine = len(self.shared_blocks)
        own_id, shared_id = id(self.own), id(self.shared)
        kind = str(
            rng.choice(
                [
                    "h2d",
                    "d2h",
                    "d2d_to_shared",
                    "d2d_from_shared",
                    "shared_d2h",
                    "shared_h2d",
                    "within",
                    "h2h",
                ]
            )
        )
        if kind == "h2d":
            dst = self.pick(n_own, k)
            data = ar.random(rng, (k, *BLOCK), DTYPE)
            self.submit(
                lambda: transfer(data, self.own, dst_blocks=dst, path=path),
                set(),
                {(own_id, int(b)) for b in dst},
            )
            self.own_bits[dst] = ar.bits(data)
        elif kind in ("d2h", "shared_d2h"):
            if kind == "d2h":
                pool, blocks, mirror, pool_id = self.own, self.pick(n_own, k), self.own_bits, own_id
                src_blocks = blocks
            else:
                pick = self.pick(n_mine, k)
                pool, mirror, pool_id = self.shared, self.shared_bits, shared_id
                blocks, src_blocks = pick, self.shared_blocks[pick]
            out = (
                np.zeros((k, *BLOCK), DTYPE)
                if rng.random() < 0.5
                else HostBuffer((k, *BLOCK), DTYPE)
            )
            expected = mirror[blocks].copy()

            def check(out: Any = out, expected: np.ndarray = expected, kind: str = kind) -> None:
                got = out.array if isinstance(out, HostBuffer) else out
                ar.assert_same(got, expected, f"{kind} result")

            self.submit(
                lambda: transfer(pool, out, src_blocks=src_blocks, path=path),
                {(pool_id, int(b)) for b in src_blocks},
                set(),
                check,
            )
        elif kind in ("d2d_to_shared", "shared_h2d"):
            pick = self.pick(n_mine, k)
            dst = self.shared_blocks[pick]
            if kind == "d2d_to_shared":
                src = self.pick(n_own, k)
                self.submit(
                    lambda: transfer(
                        self.own, self.shared, src_blocks=src, dst_blocks=dst, path=path
                    ),
                    {(own_id, int(b)) for b in src},
                    {(shared_id, int(b)) for b in dst},
                )
                self.shared_bits[pick] = self.own_bits[src]
            else:
                data = ar.random(rng, (k, *BLOCK), DTYPE)
                self.submit(
                    lambda: transfer(data, self.shared, dst_blocks=dst, path=path),
                    set(),
                    {(shared_id, int(b)) for b in dst},
                )
                self.shared_bits[pick] = ar.bits(data)
        elif kind == "d2d_from_shared":
            pick = self.pick(n_mine, k)
            src = self.shared_blocks[pick]
            dst = self.pick(n_own, k)
            self.submit(
                lambda: transfer(self.shared, self.own, src_blocks=src, dst_blocks=dst, path=path),
                {(shared_id, int(b)) for b in src},
                {(own_id, int(b)) for b in dst},
            )
            self.own_bits[dst] = self.shared_bits[pick]
        elif kind == "within":
            order = self.pick(n_own, 2 * k)
            src, dst = order[:k], order[k:]
            self.submit(
                lambda: transfer(self.own, self.own, src_blocks=src, dst_blocks=dst, path=path),
                {(own_id, int(b)) for b in src},
                {(own_id, int(b)) for b in dst},
            )
            self.own_bits[dst] = self.own_bits[src]
        else:  # h2h: no pool at all
            src_np = ar.random(rng, (k, *BLOCK), DTYPE)
            out = np.zeros((k + 2, *BLOCK), DTYPE)
            expected = np.zeros((k + 2, *BLOCK), DTYPE)
            expected[2:] = src_np[::-1]

            def check_h2h(out: np.ndarray = out, expected: np.ndarray = expected) -> None:
                ar.assert_same(out, expected, "h2h result")

            self.submit(
                lambda: transfer(
                    src_np,
                    out,
                    src_blocks=list(range(k))[::-1],
                    dst_blocks=list(range(2, k + 2)),
                    path=path,
                ),
                set(),
                set(),
                check_h2h,
            )


def test_threads_with_own_and_shared_pools(arrays, rng):
    """8 threads × 50 transfers: own pools and one shared pool (each thread owns 8 blocks of
    it), every direction, both engines, several in flight per thread."""
    n_threads, per_thread, own_blocks, mine = 8, 50, 16, 8
    shared_np = arrays.random(rng, (n_threads * mine, *BLOCK), DTYPE)
    shared = DevicePool(put(shared_np), name="shared")
    layout = rng.permutation(n_threads * mine).reshape(n_threads, mine)  # interleaved blocks
    seeds = rng.integers(1 << 32, size=n_threads)
    workers: list[Worker] = []
    for i in range(n_threads):
        own_np = arrays.random(rng, (own_blocks, *BLOCK), DTYPE)
        workers.append(
            Worker(
                arrays,
                np.random.default_rng(seeds[i]),
                DevicePool(put(own_np), name=f"own-{i}"),
                arrays.bits(own_np).copy(),
                shared,
                layout[i],
                arrays.bits(shared_np)[layout[i]].copy(),
            )
        )

    def body(i: int) -> None:
        worker = workers[i]
        for _ in range(per_thread):
            worker.step()
        worker.flush()
        arrays.assert_same(worker.own.array, worker.own_bits, f"thread {i}'s own pool")

    run_threads(n_threads, body)
    assert sum(w.done for w in workers) == n_threads * per_thread
    expected = np.empty_like(arrays.bits(shared_np))
    for worker in workers:
        expected[worker.shared_blocks] = worker.shared_bits
    arrays.assert_same(shared.array, expected, "shared pool")


def test_threads_on_a_sharded_shared_pool(arrays, rng, mesh):
    """4 threads write and read their own blocks of one pool sharded over 8 devices (4
    distinct shards, each on 2 devices), through both engines, all in flight at once."""
    n_threads, rounds, per_thread = 4, 6, 4
    sharding = NamedSharding(mesh, P(None, None, "a"))
    shape = (n_threads * per_thread, 4, 8, 16)
    init = arrays.random(rng, shape, np.float32)
    pool = DevicePool(put(init, sharding))
    n_shards, shard = 4, (shape[0], 4, 2, 16)
    final = arrays.bits(init).copy()
    lock = threading.Lock()

    def body(i: int) -> None:
        local = np.random.default_rng([i, 7])
        mine = np.arange(i * per_thread, (i + 1) * per_thread)
        for r in range(rounds):
            path = PATHS[(i + r) % 2]
            host = arrays.random(local, (n_shards, per_thread, *shard[1:]), np.float32)
            order = local.permutation(per_thread)
            transfer(host, pool, src_blocks=order, dst_blocks=mine, path=path).result(TIMEOUT)
            back = np.zeros((n_shards, per_thread, *shard[1:]), np.float32)
            transfer(pool, back, src_blocks=mine, path=PATHS[r % 2]).result(TIMEOUT)
            arrays.assert_same(back, host[:, order], f"thread {i} round {r}")
        with lock:
            for g in range(n_shards):
                final[mine, :, 2 * g : 2 * g + 2] = arrays.bits(host[g, order])

    run_threads(n_threads, body)
    for shard_data in pool.array.addressable_shards:
        arrays.assert_same(
            np.asarray(shard_data.data),
            final[shard_data.index],
            f"shard on device {shard_data.device.id}",
        )


def test_opposite_directions_between_two_pools_do_not_deadlock(arrays, rng):
    """Thread A copies pool x -> pool y while thread B copies y -> x (and batches touching
    both): each transfer takes both pools' locks, in one global order."""
    x_np = arrays.random(rng, (8, 16), np.int32)
    y_np = arrays.random(rng, (8, 16), np.int32)
    x, y = DevicePool(put(x_np)), DevicePool(put(y_np))
    rounds = 40

    def body(i: int) -> None:
        for r in range(rounds):
            path = PATHS[r % 2]
            if i == 0:
                transfer(x, y, src_blocks=[0, 1, 2], dst_blocks=[4, 5, 6], path=path).result(
                    TIMEOUT
                )
            elif i == 1:
                transfer(y, x, src_blocks=[0, 1, 2], dst_blocks=[4, 5, 6], path=path).result(
                    TIMEOUT
                )
            else:
                transfer_batch(
                    [Transfer(y, x, [3], [7]), Transfer(x, y, [3], [7])], path=path
                ).result(TIMEOUT)

    run_threads(3, body)
    want_x, want_y = x_np.copy(), y_np.copy()
    want_x[4:7], want_y[4:7] = y_np[0:3], x_np[0:3]
    want_x[7], want_y[7] = y_np[3], x_np[3]
    arrays.assert_same(x.array, want_x, "pool x")
    arrays.assert_same(y.array, want_y, "pool y")


@pytest.mark.parametrize("path", PATHS)
def test_hundreds_in_flight_without_waiting(arrays, rng, path):
    """200 transfers submitted before the first is waited for: all complete, right bytes."""
    src = DevicePool(put(arrays.random(rng, (32, 64), np.float32)))
    expected = np.asarray(src.array)
    outs = [np.zeros((4, 64), np.float32) for _ in range(200)]
    picks = [rng.choice(32, 4, replace=False) for _ in outs]
    futures = [
        transfer(src, out, src_blocks=pick, path=path)
        for out, pick in zip(outs, picks, strict=True)
    ]
    for future in futures:
        assert future.result(TIMEOUT) == 4 * 64 * 4
    for out, pick in zip(outs, picks, strict=True):
        arrays.assert_same(out, expected[pick])
