"""Real crashes: a child writing into a named /dev/shm pool is SIGKILLed at random moments; after
each kill a survivor re-attaches and every block it is served matches its key's bytes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import crash_writer as writer
import numpy as np
import pytest
from run_names import run_name

from tpusync.errors import BlocksMissingError
from tpusync.tiers import HostPool

KILLS_PER_TEST = 2  # each kill costs a child start (~3 s): several tests, not one long one


@pytest.fixture
def pool_name(tmp_path: Path) -> str:
    return run_name("crash")


def _start_writer(name: str, shm_dir: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, str(Path(writer.__file__)), name, shm_dir],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # "ready" once the pool is open; EOF if the child died
    if line.strip() != "ready":
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        pytest.fail(f"the writer did not start (said {line!r}, exit {child.returncode})")
    return child


def _verify(name: str, shm_dir: str) -> tuple[int, int]:
    """Re-attaches and checks every committed block; returns (blocks checked, torn dropped)."""
    pools = writer.make_pools()
    pool = HostPool(writer.make_layout(pools), writer.CAPACITY, name=name, shm_dir=shm_dir)
    try:
        assert pool.attached
        keys = pool.keys()
        for start in range(0, len(keys), writer.BLOCKS):
            chunk = keys[start : start + writer.BLOCKS]
            try:
                pool.get_to_device(chunk, pools, range(len(chunk)))
            except BlocksMissingError as exc:  # pragma: no cover - would be a failure below
                pytest.fail(f"committed blocks failed verification after a crash: {exc}")
            for a, device_pool in enumerate(pools):
                got = np.asarray(device_pool.array).view(np.uint16)
                for j, key in enumerate(chunk):
                    np.testing.assert_array_equal(got[j], writer.block_bytes(key, a))
        _check_raw_slots(pool, keys)
        return len(keys), pool.stats.torn_discarded
    finally:
        pool.close()


def _check_raw_slots(pool: HostPool, keys: list[bytes]) -> None:
    """The raw slots too, not only what the checksummed path serves (views die on return)."""
    views = pool.views()
    for key in keys:
        slot = pool.slot_of(key)
        for a, view in enumerate(views):
            expected = writer.block_bytes(key, a)
            np.testing.assert_array_equal(view[slot].view(np.uint16), expected)


@pytest.mark.parametrize("trial", range(4))
def test_sigkill_mid_write_never_serves_a_torn_block(pool_name: str, trial: int) -> None:
    shm_dir = "/dev/shm"
    rng = np.random.default_rng()
    checked = torn = 0
    try:
        for _ in range(KILLS_PER_TEST):
            child = _start_writer(pool_name, shm_dir)
            try:
                # Let it write a while; the kill lands at a random point of its loop.
                try:
                    child.wait(timeout=float(rng.uniform(0.2, 0.8)))
                    pytest.fail(f"the writer exited by itself ({child.returncode})")
                except subprocess.TimeoutExpired:
                    pass
                os.kill(child.pid, signal.SIGKILL)
                assert child.wait(timeout=30) == -signal.SIGKILL
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait(timeout=30)
                assert child.stdout is not None
                child.stdout.close()
            blocks, dropped = _verify(pool_name, shm_dir)
            checked += blocks
            torn += dropped
        assert checked > 0  # the survivor really had blocks to serve
        print(f"checked {checked} blocks over {KILLS_PER_TEST} kills; {torn} torn dropped")
    finally:
        (Path(shm_dir) / f"tpusync-{pool_name}.pool").unlink(missing_ok=True)
