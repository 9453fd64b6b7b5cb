"""Copies on the caller's OpenMP team (tpusync._src.memory.openmp_team): the same bytes and
checksums as on the copy engine's own threads, really run as a parallel region of the team, and
nothing changed where no OpenMP runtime is loaded.

Each case runs in a child process with a deadline (killed by pid when it passes): loading an
OpenMP runtime into the process's global scope, as PyTorch does, cannot be undone. The child
loads the system's libgomp (GCC's, present wherever gcc is) with RTLD_GLOBAL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CHILD_DEADLINE_S = 25.0

# A job table of scattered random blocks, big enough to run in parallel and to stream.
_COMMON = """
import ctypes, os
import numpy as np
from tpusync._native import core as _core
from tpusync._src.memory.openmp_team import openmp_runtime_loaded, openmp_team

def table(rng, n_blocks, block, src, dst):
    order = rng.permutation(n_blocks)
    rows = [(src.ctypes.data + int(order[i]) * block + 3, dst.ctypes.data + i * block + 8, block)
            for i in range(n_blocks)]
    return np.array(rows, dtype=np.uint64)

def threads_now():
    return len(os.listdir("/proc/self/task"))
"""

_WITH_RUNTIME = """
gomp = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
engine = _core.CopyEngine(2)
before_any = threads_now()  # the engine's own worker has started
rng = np.random.default_rng(SEED)
for block in (4096, 65_536 + 24, 1 << 20):
    n_blocks = (24 << 20) // block
    src = rng.integers(0, 256, n_blocks * block + 64, dtype=np.uint8)
    size = n_blocks * block + 64
    ours, on_team = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    jobs = table(np.random.default_rng(block), n_blocks, block, src, ours)
    hashed_ours = engine.copy_hashed(jobs)
    with openmp_team() as used:
        assert used
        jobs = table(np.random.default_rng(block), n_blocks, block, src, on_team)
        hashed_team = engine.copy_hashed(jobs)
    assert np.array_equal(ours, on_team), block
    assert np.array_equal(hashed_ours, hashed_team), block
    ours[:], on_team[:] = 0, 0
    engine.copy(table(np.random.default_rng(block + 1), n_blocks, block, src, ours))
    with openmp_team():
        engine.copy(table(np.random.default_rng(block + 1), n_blocks, block, src, on_team))
    assert np.array_equal(ours, on_team), block
    assert not _core.openmp_here(False)  # the context put this thread's setting back
# the team's worker is libgomp's thread, started by the first parallel region (OMP_NUM_THREADS=2)
print("team threads", threads_now() - before_any)
"""


def _run(code: str) -> str:
    # two threads in the team; its worker sleeps between regions (no core spent spinning)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        out, err = child.communicate(timeout=CHILD_DEADLINE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        pytest.fail(f"the child did not finish in {CHILD_DEADLINE_S} s")
    assert child.returncode == 0, err
    return out


@pytest.mark.parametrize("seed", [1, 2])
def test_copies_on_the_team_match_the_engines_bytes_and_checksums(seed: int) -> None:
    code = _COMMON + _WITH_RUNTIME.replace("SEED", str(seed))
    out = _run(code)
    # exactly one new thread: libgomp's worker, which ran half of every parallel job
    assert "team threads 1" in out, out


def test_without_a_runtime_the_engines_threads_copy() -> None:
    code = _COMMON + textwrap.dedent(
        """
        assert not openmp_runtime_loaded()
        engine = _core.CopyEngine(2)
        rng = np.random.default_rng(3)
        src = rng.integers(0, 256, (8 << 20) + 64, dtype=np.uint8)
        dst = np.zeros_like(src)
        with openmp_team() as used:
            assert not used
            digests = engine.copy_hashed(table(rng, 128, 65_536, src, dst))
        assert len(digests) == 128
        print("ok")
        """
    )
    assert "ok" in _run(code)


def test_a_one_thread_engine_stays_on_the_calling_thread() -> None:
    """TPUSYNC_COPY_THREADS=1 asks for one thread: the team is not used either."""
    code = _COMMON + textwrap.dedent(
        """
        gomp = ctypes.CDLL("libgomp.so.1", mode=ctypes.RTLD_GLOBAL)
        before = threads_now()
        engine = _core.CopyEngine(1)
        rng = np.random.default_rng(4)
        src = rng.integers(0, 256, (8 << 20) + 64, dtype=np.uint8)
        dst = np.zeros_like(src)
        with openmp_team() as used:
            assert used
            engine.copy(table(rng, 128, 65_536, src, dst))
        print("new threads", threads_now() - before)
        """
    )
    assert "new threads 0" in _run(code)
