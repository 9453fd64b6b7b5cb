"""scripts/test.sh's control flow, on fake suites: every suite runs whatever the others
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
from paths import REPO

SUITES_SH = REPO / "scripts" / "_suites.sh"


def run_fake(
    tmp_path: Path,
    args: list[str],
    *,
    exits: dict[str, int] | None = None,
    env_fails: str = "",
    suites: str | None = None,
    before: dict[str, str] | None = None,
    side_by_side: bool = True,
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Runs ``run_suites ARGS`` with fake steps in ``tmp_path``: each suite runs the shell
    commands ``before`` gives it (none by default; exit 9 if they fail), then writes its
    arguments to ``calls/<suite>``, prints a line and exits as ``exits`` says (default 0);
    ``make_env NAME`` prints a line and fails (halfway, under errexit) for the name
    ``env_fails``.
    Returns the run and the calls folder."""
    exits = {"main": 0, "vllm": 0, "sglang": 0, **(exits or {})}
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    steps = "\n".join(
        f"suite_{name}() {{ {{ {(before or {}).get(name, ':')}; }} || return 9; "
        f'echo "$@" >"{calls}/{name}"; echo "output of {name}"; return {code}; }}'
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
    env = {
        k: v for k, v in os.environ.items() if k not in ("TPUSYNC_SUITES", "TPUSYNC_SIDE_BY_SIDE")
    }
    if not side_by_side:
        env["TPUSYNC_SIDE_BY_SIDE"] = "0"
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


# a fake suite's wait for another's mark: at most 20 s (a run's timeout is 30), then it fails
WAIT_FOR = 'for _ in $(seq 200); do [[ -e "{mark}" ]] && break; sleep 0.1; done; [[ -e "{mark}" ]]'


def test_the_engine_suites_run_beside_the_main_one_and_their_output_is_shown(
    tmp_path: Path,
) -> None:
    """The main suite waits for the vLLM suite's mark: it can only pass if the vLLM suite ran
    while it was running."""
    mark = tmp_path / "vllm-ran"
    before = {"main": WAIT_FOR.format(mark=mark), "vllm": f'touch "{mark}"'}
    done, _ = run_fake(tmp_path, ["-q"], before=before)
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary(done.stdout) == {name: ("passed", "") for name in ("main", "vllm", "sglang")}
    for name in ("vllm", "sglang"):
        log = tmp_path / "logs" / f"{name}-suite.log"
        assert log.read_text() == f"output of {name}\n"  # kept, and printed after the main one
        assert f"the {name} suite's output ({log}):\noutput of {name}\n" in done.stdout
    assert done.stdout.index("output of main") < done.stdout.index("output of vllm")


def test_a_failed_engine_suite_beside_the_main_one_fails_the_run(tmp_path: Path) -> None:
    done, _ = run_fake(tmp_path, [], exits={"sglang": 1})
    assert done.returncode == 1
    assert summary(done.stdout)["sglang"] == ("failed", "(exit 1)")
    assert "the sglang suite ended (exit 1)" in done.stdout


def test_side_by_side_0_runs_the_engine_suites_after_the_main_one(tmp_path: Path) -> None:
    mark = tmp_path / "main-done"
    before = {"main": f'touch "{mark}"', "vllm": f'[[ -e "{mark}" ]]'}  # vLLM fails before it
    done, _ = run_fake(tmp_path, [], before=before, side_by_side=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (tmp_path / "logs" / "vllm-suite.log").exists()  # its output went straight out


def test_test_sh_runs_its_suites_through_suites_sh() -> None:
    """The real script: valid bash, and it defines every step _suites.sh calls."""
    script = (REPO / "scripts" / "test.sh").read_text()
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(REPO / "scripts" / "test.sh")], check=True, timeout=30)
    subprocess.run([bash, "-n", str(SUITES_SH)], check=True, timeout=30)
    for step in ("make_env", "suite_main", "suite_vllm", "suite_sglang"):
        assert f"\n{step}() {{" in script
    assert 'source "$repo/scripts/_suites.sh"\nrun_suites "$@"' in script
