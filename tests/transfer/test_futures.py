"""TransferFuture: concurrent.futures.Future semantics, asyncio, cancellation before start,
timeouts, and errors raised while a transfer runs.

A transfer is held back by holding its pool's lock from the test (every transfer that touches a
pool takes the pool's lock while it runs): the worker has started it (running) but cannot move a
byte until the test lets go. To keep a transfer *pending* (not started), every worker of the
executor is first occupied by such a held transfer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import pytest

from tpusync import DevicePool, Transfer, TransferFuture, transfer, transfer_batch
from tpusync._src.testing.polling import eventually
from tpusync.errors import (
    ArrayDeletedError,
    TpuSyncError,
    TransferFailedError,
    TransferTimeoutError,
)

TIMEOUT = 30.0
_transfer_module = importlib.import_module("tpusync._src.transfer.api")


def put(x: np.ndarray, target: Any = None) -> jax.Array:
    return jax.device_put(np.array(x, copy=True), target or jax.devices()[0])


@contextlib.contextmanager
def held(pool: DevicePool) -> Iterator[None]:
    """Holds the pool's lock: transfers touching the pool start but cannot proceed."""
    pool._lock.acquire()
    try:
        yield
    finally:
        pool._lock.release()


@pytest.fixture
def pool(arrays, rng) -> DevicePool:
    return DevicePool(put(arrays.random(rng, (8, 4, 16), np.float32)))


@pytest.fixture
def host(arrays, rng) -> np.ndarray:
    return arrays.random(rng, (8, 4, 16), np.float32)


BLOCK_BYTES = 4 * 16 * 4


def test_result_done_and_exception_after_success(arrays, pool, host, path):
    dst = host.copy()
    future = transfer(pool, dst, src_blocks=[1, 2], dst_blocks=[5, 6], path=path)
    assert isinstance(future, TransferFuture)
    assert isinstance(future, concurrent.futures.Future)
    assert future.path == path and future.nbytes == 2 * BLOCK_BYTES
    assert future.result(timeout=TIMEOUT) == 2 * BLOCK_BYTES
    assert future.done() and not future.running() and not future.cancelled()
    assert future.exception(timeout=0) is None
    assert future.cancel() is False, "a finished transfer cannot be cancelled"
    assert future.result(timeout=0) == 2 * BLOCK_BYTES  # stays available
    arrays.assert_same(dst[5:7], np.asarray(pool.array)[1:3])


def test_result_without_timeout_and_with_zero_timeout(pool, host, path):
    future = transfer(host, pool, path=path)
    assert future.result() == host.nbytes
    assert future.result(0) == host.nbytes


def test_done_callback_runs_once_on_a_worker_thread(pool, host, path):
    calls: list[tuple[Any, str]] = []
    called = threading.Event()

    def callback(future: Any) -> None:
        calls.append((future, threading.current_thread().name))
        called.set()

    with held(pool):
        future = transfer(host, pool, src_blocks=[0], dst_blocks=[3], path=path)
        future.add_done_callback(callback)
        time.sleep(0.02)
        assert not future.done() and not calls, "the transfer finished with its pool locked"
    assert called.wait(TIMEOUT)
    assert future.result(TIMEOUT) == BLOCK_BYTES
    time.sleep(0.02)
    assert len(calls) == 1
    assert calls[0][0] is future
    assert calls[0][1] != threading.current_thread().name

    late: list[Any] = []
    future.add_done_callback(late.append)  # already done: runs at once, in this thread
    assert late == [future]


def test_done_callback_of_a_failed_transfer(pool, host, path):
    seen: list[BaseException | None] = []
    source = put(host)
    with held(pool):
        future = transfer(source, pool, path=path)
        future.add_done_callback(lambda f: seen.append(f.exception()))
        source.delete()
    with pytest.raises(ArrayDeletedError):
        future.result(TIMEOUT)
    eventually(lambda: len(seen) == 1, TIMEOUT, "the callback ran", interval=0.001)
    assert isinstance(seen[0], ArrayDeletedError)


def test_awaitable_with_asyncio(arrays, pool, host, path):
    dst = np.zeros_like(host)

    async def main() -> list[int]:
        single = await transfer(pool, dst, src_blocks=[7], dst_blocks=[0], path=path)
        several = await asyncio.gather(
            *(transfer(host, pool, src_blocks=[i], dst_blocks=[i], path=path) for i in range(2, 6)),
            transfer(pool, dst, src_blocks=[1], dst_blocks=[1], path=path),
        )
        return [single, *several]

    assert asyncio.run(main()) == [BLOCK_BYTES] * 6
    arrays.assert_same(np.asarray(pool.array)[2:6], host[2:6])


def test_awaiting_a_failed_transfer_raises(pool, host, path):
    source = put(host)

    async def main() -> None:
        with held(pool):
            future = transfer(source, pool, path=path)
            source.delete()
        await future

    with pytest.raises(ArrayDeletedError):
        asyncio.run(main())


def test_awaiting_a_held_transfer_does_not_block_the_event_loop(pool, host, path):
    """While a transfer is held (its pool locked for 0.2 s, released by a loop callback),
    awaiting it leaves the event loop free to run other tasks."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    async def main() -> tuple[int, int]:
        locked = [pool._lock.acquire()]

        def release() -> None:
            pool._lock.release()
            locked.clear()

        try:
            future = transfer(host, pool, path=path)  # the lock is reentrant for this thread
            asyncio.get_running_loop().call_later(0.2, release)
            task = asyncio.create_task(ticker())
            await asyncio.sleep(0)
            before = ticks
            result = await future
            task.cancel()
            return result, ticks - before
        finally:
            if locked:
                release()

    result, ticked = asyncio.run(main())
    assert result == host.nbytes
    assert ticked >= 3, "the event loop was blocked while the transfer was awaited"


def test_submitting_does_not_wait_for_a_running_transfer_on_the_same_pool(arrays, pool, host, path):
    """transfer() only validates and queues: it must return at once even while another
    transfer on the same pool runs (simulated by another thread holding the pool's lock for up
    to 2 s), or asyncio code submitting transfers would stall its event loop."""
    locked, release = threading.Event(), threading.Event()

    def holder() -> None:
        with held(pool):
            locked.set()
            release.wait(2.0)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert locked.wait(TIMEOUT)
        start = time.monotonic()
        future = transfer(host, pool, path=path)
        submit_s = time.monotonic() - start
    finally:
        release.set()
        thread.join(TIMEOUT)
    assert future.result(TIMEOUT) == host.nbytes
    arrays.assert_same(pool.array, host)
    assert submit_s < 0.5, f"transfer() blocked {submit_s:.2f} s on the pool's lock"


def test_timeout_on_a_held_transfer(arrays, pool, host, path):
    expected = np.array(host[::-1], copy=True)
    with held(pool):
        future = transfer(expected, pool, path=path)
        start = time.monotonic()
        with pytest.raises(TransferTimeoutError) as info:
            future.result(timeout=0.01)
        assert time.monotonic() - start < 5
        assert isinstance(info.value, TimeoutError) and isinstance(info.value, TpuSyncError)
        assert "result()" in str(info.value)
        with pytest.raises(TimeoutError):
            future.exception(timeout=0.01)
        assert not future.done()
        assert future.cancel() is False, "a started transfer cannot be cancelled"
    # the timeout did not cancel it: it completes once the lock is free
    assert future.result(TIMEOUT) == host.nbytes
    arrays.assert_same(pool.array, expected)


def _occupy_every_worker(pool: DevicePool, host: np.ndarray, path: str) -> list[Any]:
    """Starts one held transfer per worker (the pool's lock must be held)."""
    workers = _transfer_module._get_executor()._max_workers
    blockers = [
        transfer(host, pool, src_blocks=[i % 8], dst_blocks=[i % 8], path=path)
        for i in range(workers)
    ]
    eventually(
        lambda: all(b.running() for b in blockers),
        TIMEOUT,
        "every worker runs a held transfer",
        interval=0.001,
    )
    return blockers


def test_cancel_before_start(arrays, rng, pool, host, path):
    target = arrays.random(rng, (8, 4, 16), np.float32)
    before = target.copy()
    other_pool = DevicePool(put(arrays.random(rng, (8, 4, 16), np.float32)))
    pool_before = arrays.bits(other_pool.array).copy()
    calls: list[Any] = []
    with held(pool):
        blockers = _occupy_every_worker(pool, host, path)
        pending = [
            transfer(host, target, src_blocks=[0], dst_blocks=[1], path=path),
            transfer(host, other_pool, path=path),
            transfer_batch([Transfer(other_pool, target, [2], [3])], path=path),
        ]
        for future in pending:
            assert not future.running() and not future.done()
            future.add_done_callback(calls.append)
            assert future.cancel() is True
            assert future.cancelled() and future.done()
    for blocker in blockers:
        assert blocker.result(TIMEOUT) == BLOCK_BYTES
    for future in pending:
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(TIMEOUT)
    assert calls == pending, "each callback runs once, at cancellation"
    time.sleep(0.05)  # give a wrongly started transfer the time to write
    arrays.assert_same(target, before, "host destination of a cancelled transfer")
    arrays.assert_same(other_pool.array, pool_before, "pool destination of a cancelled transfer")
    # the executor is healthy afterwards
    assert transfer(host, target, path=path).result(TIMEOUT) == host.nbytes


def test_cancel_of_a_running_transfer_fails_and_it_completes(arrays, pool, host, path):
    with held(pool):
        future = transfer(host, pool, path=path)
        eventually(future.running, TIMEOUT, "the transfer started", interval=0.001)
        assert future.cancel() is False
    assert future.result(TIMEOUT) == host.nbytes
    arrays.assert_same(pool.array, host)


@pytest.mark.parametrize("what", ["source array", "source pool", "destination pool"])
def test_array_donated_between_submit_and_run(arrays, rng, pool, host, path, what):
    """The caller donates an array after transfer() validated it but before the worker ran:
    the future fails with ArrayDeletedError, nothing is written, nothing hangs, and the pool
    (its lock) still works afterwards."""
    dst = host.copy()
    donate = jax.jit(lambda x: x + 1, donate_argnums=0)
    before = None
    if what == "source array":
        source = put(arrays.random(rng, (8, 4, 16), np.float32))
        before = arrays.bits(pool.array).copy()
        with held(pool):
            future = transfer(source, pool, path=path)
            donate(source)
    elif what == "source pool":
        with held(pool):
            future = transfer(pool, dst, path=path)
            donate(pool.array)  # without pool.update(): the pool's array is gone
    else:
        with held(pool):
            future = transfer(host, pool, path=path)
            donate(pool.array)
    with pytest.raises(ArrayDeletedError) as info:
        future.result(TIMEOUT)
    assert isinstance(info.value, TpuSyncError) and isinstance(info.value, ValueError)
    assert future.exception(0) is info.value
    arrays.assert_same(dst, host, "host destination")
    if before is not None:
        arrays.assert_same(pool.array, before, "pool destination")
    # the pool's lock was released
    if before is None:
        pool.update(put(host))
    assert transfer(host, pool, path=path).result(TIMEOUT) == host.nbytes


def test_failure_while_moving_bytes_is_a_transfer_failed_error(monkeypatch, pool, host, path):
    engine = importlib.import_module(
        {"native": "tpusync._src.engines.native", "jax": "tpusync._src.engines.pure_jax"}[path]
    )

    def boom(moves: Any) -> int:
        raise RuntimeError("boom: the engine failed")

    monkeypatch.setattr(engine, "run", boom)
    future = transfer(host, pool, path=path)
    with pytest.raises(TransferFailedError) as info:
        future.result(TIMEOUT)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, TpuSyncError)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert "boom" in str(info.value)
    monkeypatch.undo()
    assert transfer(host, pool, path=path).result(TIMEOUT) == host.nbytes


def test_empty_transfer_is_done_at_once(pool, host, path):
    calls: list[Any] = []
    future = transfer(host, pool, src_blocks=[], dst_blocks=[], path=path)
    assert future.done()
    assert future.result(timeout=0) == 0
    future.add_done_callback(calls.append)
    assert calls == [future]
    assert asyncio.run(_await(future)) == 0


async def _await(future: TransferFuture) -> int:
    return await future


def test_futures_work_with_wait_and_as_completed(pool, host, path):
    dsts = [np.zeros_like(host) for _ in range(6)]
    futures = [transfer(pool, d, path=path) for d in dsts]
    done, not_done = concurrent.futures.wait(futures, timeout=TIMEOUT)
    assert not not_done and len(done) == 6
    assert (
        sorted(f.result() for f in concurrent.futures.as_completed(futures, TIMEOUT))
        == [host.nbytes] * 6
    )


def test_batch_future_counts_every_pair(arrays, rng, pool, host, path):
    other = DevicePool(put(arrays.random(rng, (8, 4, 16), np.float32)))
    dst = np.zeros_like(host)
    future = transfer_batch(
        [Transfer(pool, dst, [0, 1], [0, 1]), Transfer(host, other, [3], [4])], path=path
    )
    assert future.nbytes == 3 * BLOCK_BYTES and future.path == path
    assert future.result(TIMEOUT) == 3 * BLOCK_BYTES
