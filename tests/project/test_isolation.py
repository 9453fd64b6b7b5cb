"""The suite beside other work: each pytest session has a base temporary directory of
its own (not the user's shared /tmp/pytest-of-<user>, whose older directories every new
session removes), and what the tests make in /dev/shm carries the run's tag, so a leak check
sees this run's names only."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO
from run_names import RUN_TAG, run_entries, run_name

from tpusync._src.testing.polling import eventually


def test_the_session_has_a_base_temporary_directory_of_its_own(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    base = tmp_path_factory.getbasetemp()
    assert base.name.startswith(f"{RUN_TAG}-pytest-")
    assert not any(part.startswith("pytest-of-") for part in base.parts)
    assert tmp_path.is_relative_to(base)
    assert os.environ["TPUSYNC_TEST_RUN"] == RUN_TAG  # what child processes name things with


def test_a_session_beside_this_one_keeps_to_its_own_directories(tmp_path: Path) -> None:
    """Another pytest session of the same user runs to its end meanwhile: it had another run
    tag and base directory, removed that directory at its end, and left this test's alone."""
    mine = tmp_path / "mine"
    mine.write_text("still here")
    env = {k: v for k, v in os.environ.items() if k != "TPUSYNC_TEST_RUN"}
    other = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "tests/project/test_scripts.py::test_an_unknown_suite_is_refused",
        ],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert other.returncode == 0, other.stdout + other.stderr
    found = re.search(r"run (tpt-[0-9a-f]+), basetemp (\S+)", other.stdout)
    assert found is not None, other.stdout
    assert found[1] != RUN_TAG
    assert not Path(found[2]).exists()  # removed at the end of that session
    assert mine.read_text() == "still here"


def test_leak_checks_see_this_runs_names_only(tmp_path: Path) -> None:
    ours = tmp_path / run_name("leak")
    theirs = tmp_path / "tpt-0000beef-leak-000000000000"  # another run's
    pool = tmp_path / "tpusync-someone-else.pool"  # another program's
    for path in (ours, theirs, pool):
        path.write_bytes(b"x")
    assert run_entries(tmp_path) == [ours]
    assert run_entries(tmp_path, within="leak-") == sorted([ours, theirs])


PROBE = "TPUSYNC_TEST_SIGTERM_PROBE"  # set only by the test below, for its child session


@pytest.mark.skipif(PROBE not in os.environ, reason="the child session of the test below")
def test_sigterm_probe(shm_names) -> None:
    """Makes a named pool file (as a test's pool) and a bare file (as a killed child's), says
    so, and waits to be stopped."""
    from tpusync._src.tiers.dram import pool_path

    pool_path(shm_names()).write_bytes(b"pool")
    Path("/dev/shm", run_name("orphan")).write_bytes(b"orphan")
    Path(os.environ[PROBE]).write_text("ready")
    time.sleep(60)


def test_a_session_stopped_by_sigterm_leaves_nothing_in_dev_shm(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    env = {k: v for k, v in os.environ.items() if k != "TPUSYNC_TEST_RUN"}
    tag = f"tpt-{os.urandom(4).hex()}"
    env.update({PROBE: str(ready), "TPUSYNC_TEST_RUN": tag})
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
         "tests/project/test_isolation.py::test_sigterm_probe"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        eventually(ready.exists, 60, "the child session made its files")
        assert len(run_entries("/dev/shm", within=tag)) == 2
        child.send_signal(signal.SIGTERM)
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=60)
        left = run_entries("/dev/shm", within=tag)
        for path in left:  # the child's names: removed here too when it failed to
            path.unlink(missing_ok=True)
    assert child.returncode != 0, out  # interrupted, not passed
    assert left == [], out
    assert "removed what this run left in /dev/shm" in out, out
