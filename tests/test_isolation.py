"""The suite beside other work (issue 54): each pytest session has a base temporary directory of
its own (not the user's shared /tmp/pytest-of-<user>, whose older directories every new
session removes), and what the tests make in /dev/shm carries the run's tag, so a leak check
sees this run's names only."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from run_names import RUN_TAG, run_entries, run_name

ROOT = Path(__file__).resolve().parents[1]


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
        [sys.executable, "-m", "pytest", "tests/test_scripts.py::test_an_unknown_suite_is_refused"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
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
