"""scripts/test.sh's control flow (issue 54), on fake suites: every suite runs whatever the others
did, the run ends with one line per suite and fails if any suite failed, and the engine
environments' build logs stay. The steps (``make_env``, ``suite_main``, ...) are shell functions
that record their arguments; scripts/_suites.sh, which test.sh sources, runs them as test.sh
does. Nothing is built or installed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUITES_SH = ROOT / "scripts" / "_suites.sh"


def run_fake(
    tmp_path: Path,
    args: list[str],
    *,
    exits: dict[str, int] | None = None,
    env_fails: str = "",
    suites: str | None = None,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Runs ``run_suites ARGS`` with fake steps in ``tmp_path``: each suite exits as ``exits``
    says (default 0) and writes its arguments to ``calls/<suite>``; ``make_env NAME`` prints a
    line and fails (halfway, under errexit) for the name ``env_fails``. Returns the run and
    the calls folder."""
    exits = {"main": 0, "vllm": 0, "sglang": 0, **(exits or {})}
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    steps = "\n".join(
        f'suite_{name}() {{ echo "$@" >"{calls}/{name}"; return {code}; }}'
        for name, code in exits.items()
    )
    driver = f"""set -euo pipefail
logs="{tmp_path}/logs"
make_env() {{
    echo "making $1" >>"{calls}/envs"
    echo "pip output of $1"
    [[ "$1" != "{env_fails}" ]]
    echo "$1 made"
}}
{steps}
source "{SUITES_SH}"
run_suites "$@"
"""
    env = {k: v for k, v in os.environ.items() if k != "TPUSYNC_SUITES"}
    if suites is not None:
        env["TPUSYNC_SUITES"] = suites
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run(
        [bash, "-c", driver, "driver", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done, calls


def summary(out: str) -> dict[str, tuple[str, str]]:
    """The summary's lines: suite -> (status, note)."""
    lines = re.findall(r"^  (main|vllm|sglang) +(\w+) +\d+ s(.*)$", out, re.MULTILINE)
    return {name: (status, note.strip()) for name, status, note in lines}


def test_a_failed_main_suite_does_not_stop_the_engine_suites(tmp_path: Path) -> None:
    done, calls = run_fake(tmp_path, ["-q"], exits={"main": 1})
    assert done.returncode == 1, done.stdout + done.stderr
    assert (calls / "vllm").read_text() == "-q\n" and (calls / "sglang").read_text() == "-q\n"
    assert summary(done.stdout) == {
        "main": ("failed", "(exit 1)"),
        "vllm": ("passed", ""),
        "sglang": ("passed", ""),
    }
    assert "1 of 3 suites failed" in done.stdout


def test_every_suite_passing_exits_0(tmp_path: Path) -> None:
    done, _ = run_fake(tmp_path, [])
    assert done.returncode == 0, done.stdout + done.stderr
    assert {status for status, _ in summary(done.stdout).values()} == {"passed"}


def test_an_engine_environment_that_fails_is_reported_and_its_log_kept(tmp_path: Path) -> None:
    done, calls = run_fake(tmp_path, [], env_fails="vllm")
    assert done.returncode == 1
    log = tmp_path / "logs" / "vllm-env.log"
    assert log.read_text() == "pip output of vllm\n"  # stopped where it failed (errexit)
    assert "sglang made" in (tmp_path / "logs" / "sglang-env.log").read_text()
    assert not (calls / "vllm").exists() and (calls / "sglang").exists()
    assert summary(done.stdout)["vllm"] == ("failed", f"(its environment was not made: {log})")
    assert f"making the vllm environment failed: {log}" in done.stderr
    assert "pip output of vllm" in done.stderr  # the log's tail is shown too


def test_suites_not_selected_are_skipped_and_their_environments_not_made(
    tmp_path: Path,
) -> None:
    done, calls = run_fake(tmp_path, [], suites="main")
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (calls / "envs").exists()
    assert summary(done.stdout) == {
        "main": ("passed", ""),
        "vllm": ("skipped", "(not in TPUSYNC_SUITES)"),
        "sglang": ("skipped", "(not in TPUSYNC_SUITES)"),
    }
    done, calls = run_fake(tmp_path, [], suites="vllm")
    assert (calls / "envs").read_text() == "making vllm\n"
    assert summary(done.stdout)["main"][0] == "skipped"


def test_an_unknown_suite_is_refused(tmp_path: Path) -> None:
    done, calls = run_fake(tmp_path, [], suites="main vlm")
    assert done.returncode == 2
    assert "TPUSYNC_SUITES: unknown suite 'vlm'" in done.stderr
    assert not list(calls.iterdir())


def test_test_paths_go_to_the_main_suite_only_and_options_to_all(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("")
    args = ["-q", "tests/test_x.py::test_one", "-k", "fast", "tests"]
    done, calls = run_fake(tmp_path, args)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (calls / "main").read_text().split() == args
    assert (calls / "vllm").read_text().split() == ["-q", "-k", "fast"]


@pytest.mark.parametrize(
    "args, status", [(["-k", "nothing"], "skipped"), (["-mslow"], "skipped"), ([], "failed")]
)
def test_a_suite_that_collects_nothing_fails_unless_tests_were_selected(
    tmp_path: Path, args: list[str], status: str
) -> None:
    done, _ = run_fake(tmp_path, args, exits={"sglang": 5})
    assert summary(done.stdout)["sglang"][0] == status
    assert done.returncode == (1 if status == "failed" else 0)


def test_test_sh_runs_its_suites_through_suites_sh() -> None:
    """The real script: valid bash, and it defines every step _suites.sh calls."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(ROOT / "scripts" / "test.sh")], check=True, timeout=30)
    subprocess.run([bash, "-n", str(SUITES_SH)], check=True, timeout=30)
    for step in ("make_env", "suite_main", "suite_vllm", "suite_sglang"):
        assert f"\n{step}() {{" in script
    assert 'source "$repo/scripts/_suites.sh"\nrun_suites "$@"' in script
