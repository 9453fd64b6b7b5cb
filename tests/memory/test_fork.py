"""fork() after tpusync ran: a child uses the copy engine and the host tiers, and is refused JAX.

Every test forks for real (os.fork() or multiprocessing's "fork" start method) after the parent
used the native copy engine, whose worker threads do not survive a fork. The child does its work
and exits 0; the parent waits with a deadline and kills the child by pid when it passes, so a
deadlock fails the test instead of hanging it. A child's traceback comes back through a pipe.

JAX started in this session (conftest), and JAX warns in the parent at every fork: "os.fork()
was called ... JAX is multithreaded". The warning is the point of these tests, so it is ignored
on them (below), as is Python 3.12's warning that forking a multithreaded process may deadlock
the child (the engine's threads are why this file exists). The error class and the fork
record are looked up where used, so that at a commit without them each test fails on its own.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest

import tpusync
from tpusync import DevicePool, HostBuffer, errors, transfer
from tpusync._native import core as _core
from tpusync.tiers import ArrayLayout, DiskPool, HostPool, PoolLayout

pytestmark = [
    # JAX's own at-fork warning, given in the parent at each fork (JAX started in conftest)
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
    # Python >= 3.12: "This process ... is multi-threaded, use of fork() may lead to deadlocks"
    pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning"),
]

CHILD_DEADLINE = 20.0  # a child that has not exited by then is deadlocked
BIG = 6 << 20  # above the engine's 1 MiB parallel threshold: the worker threads take part
ROWS, COLS = 16, 512  # one array's part of a block: 16 x 512 bf16 = 16 KiB


def _wait_or_kill(pid: int, deadline_s: float) -> int | None:
    """The child's exit code, or None after killing it by pid when the deadline passed."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


def in_forked_child(work: Callable[[], None], deadline_s: float = CHILD_DEADLINE) -> None:
    """Runs ``work`` in a child of a real os.fork(); fails with the child's traceback, or as a
    deadlock when the child did not exit within ``deadline_s``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read_end)
            work()
            code = 0
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        code = _wait_or_kill(pid, deadline_s)
        os.set_blocking(read_end, False)
        try:
            report = os.read(read_end, 1 << 16).decode(errors="replace")
        except BlockingIOError:
            report = ""
    finally:
        os.close(read_end)
    assert code is not None, f"the forked child was still running after {deadline_s} s: deadlock"
    assert code == 0, f"the forked child failed (exit {code}):\n{report}"


def use_engine(rng: np.random.Generator) -> None:
    """A parallel copy through tpusync.transfer, so the engine and its threads exist."""
    src = rng.integers(1, 256, BIG, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert transfer(src, dst, path="native").result(30) == BIG
    np.testing.assert_array_equal(dst, src)


def host_transfers(seed: int) -> None:
    """numpy -> numpy and HostBuffer -> numpy -> HostBuffer through transfer(), blocks
    scattered; checks every byte."""
    rng = np.random.default_rng(seed)
    src = rng.integers(1, 256, (12, BIG // 12), dtype=np.uint8)
    order = rng.permutation(12)
    dst = np.zeros_like(src)
    assert transfer(src, dst, src_blocks=order, path="native").result(30) == src.nbytes
    np.testing.assert_array_equal(dst, src[order])
    with HostBuffer(src.shape, np.uint8) as first, HostBuffer(src.shape, np.uint8) as second:
        first.array[...] = src
        transfer(first, dst, dst_blocks=order, path="native").result(30)
        transfer(dst, second, path="native").result(30)
        np.testing.assert_array_equal(dst[order], src)
        np.testing.assert_array_equal(second.array[order], src)


def make_layout() -> PoolLayout:
    arrays = tuple(ArrayLayout(name, "bfloat16", (ROWS, COLS), 0, 1) for name in ("k", "v"))
    return PoolLayout("fork-test", arrays)


def key_for(i: int) -> bytes:
    return i.to_bytes(8, "little") * 2


def fill(host: HostPool, keys: list[bytes], seed: int) -> dict[bytes, np.ndarray]:
    """Stores random bytes under every key through the slot interface; returns them."""
    rng = np.random.default_rng(seed)
    n = host.layout.payload_bytes
    payloads = {key: rng.integers(1, 256, n, dtype=np.uint8) for key in keys}
    reservation = host.reserve(keys)
    for key, slot in zip(reservation.keys, reservation.slots.tolist(), strict=True):
        with host.slot_memory(slot) as memory:
            np.frombuffer(memory, np.uint8)[:n] = payloads[key]
    host.commit(reservation, host.hash_slots(reservation.slots))
    return payloads


def check(host: HostPool, payloads: dict[bytes, np.ndarray]) -> None:
    n = host.layout.payload_bytes
    for key, payload in payloads.items():
        slot = host.slot_of(key)
        assert slot is not None, f"{key.hex()} is not in the pool"
        with host.slot_memory(slot) as memory:
            assert np.array_equal(np.frombuffer(memory, np.uint8)[:n], payload), key.hex()


def host_tiers(directory: Path, seed: int) -> None:
    """A HostPool -> HostPool -> DiskPool -> HostPool round trip made in this process, every
    move through the copy engine (checksummed copies), every byte checked."""
    layout = make_layout()
    keys = [key_for(i) for i in range(16)]
    with HostPool(layout, 16) as first, HostPool(layout, 16) as second:
        payloads = fill(first, keys, seed)
        assert second.put(keys, first) == len(keys)
        check(second, payloads)
        directory.mkdir()
        with DiskPool(layout, 32, directory, slab_slots=8) as disk:
            assert disk.put(keys, second) == len(keys)
            with HostPool(layout, 16) as third:
                disk.get(keys, third)
                check(third, payloads)


# --- the copy engine and host transfers in a forked child -------------------------------------


def test_forked_child_transfers_host_arrays(rng: np.random.Generator) -> None:
    use_engine(rng)
    seed = int(rng.integers(1 << 31))
    in_forked_child(lambda: host_transfers(seed))
    host_transfers(seed)  # and the parent's engine still works


def test_forked_child_can_use_an_inherited_engine_object(rng: np.random.Generator) -> None:
    """A CopyEngine made before the fork (its workers gone) still copies in the child, on the
    calling thread, and is freed there without waiting for them."""
    engine = _core.CopyEngine(3, min_parallel_bytes=0)
    src = rng.integers(1, 256, BIG, dtype=np.uint8)

    quarter = BIG // 4

    def table(dst: np.ndarray) -> np.ndarray:  # four segments, in reverse order
        rows = [
            (src.ctypes.data + i * quarter, dst.ctypes.data + i * quarter, quarter)
            for i in reversed(range(4))
        ]
        return np.array(rows, dtype=np.uint64)

    first = np.zeros_like(src)
    assert engine.copy(table(first)) == BIG  # the workers ran
    np.testing.assert_array_equal(first, src)

    def child() -> None:
        nonlocal engine
        dst = np.zeros_like(src)
        assert engine.copy(table(dst)) == BIG
        np.testing.assert_array_equal(dst, src)
        hashed = np.zeros_like(src)
        digests = engine.copy_hashed(table(hashed))
        np.testing.assert_array_equal(hashed, src)
        pieces = [src[i * quarter : (i + 1) * quarter] for i in reversed(range(4))]
        assert digests.tolist() == [_core.sum64(piece) for piece in pieces]
        del engine  # destroy in the child: must not join or wait for the parent's threads

    in_forked_child(child)
    again = np.zeros_like(src)
    assert engine.copy(table(again)) == BIG  # the parent's engine is untouched
    np.testing.assert_array_equal(again, src)


def test_fork_while_another_thread_copies(rng: np.random.Generator) -> None:
    """Forks while a parent thread is inside a parallel copy: the engine's locks may be held
    by threads that do not exist in the child, which must neither take nor wait for them."""
    use_engine(rng)
    src = rng.integers(1, 256, 4 * BIG, dtype=np.uint8)
    dst = np.zeros_like(src)
    stop = threading.Event()
    copies = 0

    def copier() -> None:
        nonlocal copies
        while not stop.is_set():
            transfer(src, dst, path="native").result(30)
            copies += 1

    thread = threading.Thread(target=copier, name="fork-test-copier")
    thread.start()
    seed = int(rng.integers(1 << 31))
    try:
        for _ in range(4):
            time.sleep(0.01)
            in_forked_child(lambda: host_transfers(seed))
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive() and copies > 0
    np.testing.assert_array_equal(dst, src)


def test_forked_child_uses_host_pools(rng: np.random.Generator, tmp_path: Path) -> None:
    """The child reads the pool it inherited (anonymous memory: its own copy after the fork)
    and makes and uses HostPools and a DiskPool of its own."""
    layout = make_layout()
    keys = [key_for(100 + i) for i in range(8)]
    with HostPool(layout, 16) as parents:
        payloads = fill(parents, keys, int(rng.integers(1 << 31)))
        use_engine(rng)
        seed = int(rng.integers(1 << 31))

        def child() -> None:
            check(parents, payloads)
            with HostPool(layout, 8) as copy:
                assert copy.put(keys, parents) == len(keys)  # through the child's engine
                check(copy, payloads)
            host_tiers(tmp_path / "child-disk", seed)

        in_forked_child(child)
        check(parents, payloads)
    host_tiers(tmp_path / "parent-disk", seed)


def test_tiers_with_io_threads_are_refused_in_a_forked_child(
    rng: np.random.Generator, tmp_path: Path
) -> None:
    """A DiskPool or SharedFsPool opened in the parent has I/O threads the child lacks: using
    it in a forked child raises PoolBusyError at once (it used to wait forever), and the
    parent's pools still work after the child is gone."""
    from tpusync.tiers import SharedFsPool

    layout = make_layout()
    keys = [key_for(200 + i) for i in range(8)]
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "shared").mkdir(mode=0o700)
    with (
        HostPool(layout, 16) as dram,
        DiskPool(layout, 32, tmp_path / "disk", slab_slots=8) as disk,
        SharedFsPool(layout, tmp_path / "shared") as shared,
    ):
        payloads = fill(dram, keys, int(rng.integers(1 << 31)))
        assert disk.put(keys, dram) == len(keys)
        assert shared.put(keys, dram) == len(keys)

        def child() -> None:
            with HostPool(layout, 16) as target:
                for tier in (disk, shared):
                    with pytest.raises(errors.PoolBusyError, match="fork of it"):
                        tier.get(keys, target)
                    with pytest.raises(errors.PoolBusyError, match="fork of it"):
                        tier.contains(keys)

        in_forked_child(child)
        for tier in (disk, shared):
            with HostPool(layout, 16) as target:
                tier.get(keys, target)
                check(target, payloads)


# --- multiprocessing's fork start method ----------------------------------------------------------


def _pool_task(task: tuple[int, str]) -> int:
    seed, directory = task
    host_transfers(seed)
    host_tiers(Path(directory), seed)
    return seed


def test_multiprocessing_fork_workers_use_engine_and_tiers(
    rng: np.random.Generator, tmp_path: Path
) -> None:
    use_engine(rng)
    tasks = [(int(rng.integers(1 << 31)), str(tmp_path / f"task-{i}")) for i in range(4)]
    pool = multiprocessing.get_context("fork").Pool(2)
    try:
        assert pool.map_async(_pool_task, tasks).get(CHILD_DEADLINE) == [s for s, _ in tasks]
        pool.close()
    finally:
        pool.terminate()  # stops the workers by pid (also after a deadlock's timeout)
        pool.join()


# --- JAX in a forked child ---------------------------------------------------------------------


def test_device_calls_in_forked_child_raise_a_clear_error(rng: np.random.Generator) -> None:
    """JAX started in the parent and does not survive a fork: every device-side call of
    tpusync in the child raises JaxForkError at once (never hangs), host calls still work."""
    device = jax.device_put(rng.integers(1, 256, (8, 64), dtype=np.uint8))
    pool = DevicePool(jax.device_put(rng.integers(1, 256, (8, 64), dtype=np.uint8)))
    layout = PoolLayout.from_pools("fork-device", [pool])
    host = HostPool(layout, 8)
    use_engine(rng)
    parent = os.getpid()

    def refused(call: Callable[[], object], argument: str) -> None:
        with pytest.raises(errors.JaxForkError) as caught:
            call()
        message = str(caught.value)
        assert isinstance(caught.value, errors.TpuSyncError)
        assert isinstance(caught.value, RuntimeError)
        assert message.startswith(f"{argument}: ") and f"process {parent}" in message, message
        assert "spawn" in message, message

    def child() -> None:
        assert tpusync._src.memory.fork_guard.jax_forked_from == parent
        out = np.zeros((8, 64), np.uint8)
        refused(lambda: transfer(device, out), "src")
        refused(lambda: transfer(out, pool), "dst")
        refused(lambda: transfer(pool, out, path="jax"), "src")
        refused(lambda: DevicePool.zeros((8, 64), np.uint8), "DevicePool.zeros")
        refused(lambda: DevicePool(device), "array")
        refused(lambda: pool.update(device), "array")
        refused(lambda: host.put_from_device([key_for(1)], [pool], [0]), "pools")
        refused(lambda: host.get_to_device([key_for(1)], [pool], [0]), "pools")
        refused(lambda: host.prepare([pool]), "pools")
        refused(tpusync.info, "tpusync.info")
        host_transfers(7)  # the host side is unaffected
        host.close()

    try:
        in_forked_child(child)
        assert tpusync._src.memory.fork_guard.jax_forked_from is None  # the parent's JAX is fine
        host.put_from_device([key_for(1)], [pool], [3])
        assert host.contains([key_for(1)]) == [True]
    finally:
        host.close()


_BEFORE_AND_AFTER_JAX = r"""
import os, sys
import numpy as np
import tpusync
from tpusync._src.memory import fork_guard

def child(check):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = 0 if check() else 3
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def fresh_jax_in_child():  # JAX never started in the parent: the child may start its own
    import jax
    out = np.zeros(16, np.uint8)
    tpusync.transfer(jax.device_put(np.arange(1, 17, dtype=np.uint8)), out).result(60)
    return fork_guard.jax_forked_from is None and out.tolist() == list(range(1, 17))

assert child(fresh_jax_in_child) == 0, "refused or failed in a child forked before JAX started"
import jax
jax.devices()
parent = os.getpid()
assert child(lambda: fork_guard.jax_forked_from == parent) == 0, "not refused after JAX started"
print("ok")
"""


def test_only_children_forked_after_jax_started_are_refused() -> None:
    """A fresh interpreter: a child forked before JAX started may use JAX (and tpusync's device
    calls); one forked after it is refused."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    done = subprocess.run(
        [sys.executable, "-c", _BEFORE_AND_AFTER_JAX],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


_FIRST_USE_IN_CHILD = r"""
import os, sys
import numpy as np
import tpusync  # imports no JAX, nor tpusync's transfer machinery, until first used
assert "jax" not in sys.modules and "tpusync._src.transfer.api" not in sys.modules, "not lazy"
import jax
array = jax.device_put(np.arange(16, dtype=np.uint8))
pid = os.fork()
if pid == 0:
    code = 3
    try:
        tpusync.transfer(array, np.zeros(16, np.uint8)).result(60)
    except tpusync.errors.JaxForkError:
        code = 0
    finally:
        os._exit(code)
assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "the child was not refused"
print("ok")
"""


def test_a_child_is_refused_where_its_first_tpusync_call_comes_after_the_fork() -> None:
    """`import tpusync` imports the rest on first use (issue 54), but its fork guard from the
    start: a child forked after JAX started is refused even where the parent never called
    tpusync before the fork."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": "ignore::RuntimeWarning"}
    done = subprocess.run(
        [sys.executable, "-c", _FIRST_USE_IN_CHILD],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
