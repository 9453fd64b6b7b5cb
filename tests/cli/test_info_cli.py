"""tpusync.info() and the `tpusync` command (run as real subprocesses)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
from run_names import run_name

import tpusync
from tpusync._src.info import check_o_direct


def test_info_reports_every_device_with_a_reason(tmp_path: Path) -> None:
    report = tpusync.info(str(tmp_path))
    assert len(report.devices) == len(jax.devices())
    for device in report.devices:
        assert device.platform == "cpu"
        assert device.path == "native"
        assert device.reason == "CPU backend: raw memory"
    host = report.host
    assert host is not None
    assert host.o_direct_dir == str(tmp_path)
    assert host.copy_threads >= 1 and host.cpu_count >= 1
    assert host.shm_total_bytes is None or host.shm_total_bytes > 0
    text = str(report)
    assert "CPU backend: raw memory" in text and "RLIMIT_MEMLOCK" in text
    assert report.as_dict()["devices"][0]["path"] == "native"


def test_o_direct_check_says_why_not_on_tmpfs(tmp_path: Path) -> None:
    ok, reason = check_o_direct("/dev/shm")
    if not ok:  # tmpfs refuses O_DIRECT on most kernels
        assert reason
    ok, reason = check_o_direct(str(tmp_path / "missing"))
    assert not ok and "cannot create a file there" in reason
    assert not any(p.name.startswith(".tpusync-odirect") for p in tmp_path.iterdir())


def _run(
    *args: str, timeout: float = 120, tmpdir: Path | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run(
        [sys.executable, "-m", "tpusync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def test_cli_info_json() -> None:
    result = _run("info", "--json")
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    assert payload["version"] == tpusync.__version__
    assert payload["devices"][0]["path"] == "native"


def test_cli_demo_small_run_reports_equal_bits() -> None:
    result = _run("demo", "--transfer", "--layers", "1", "--repeats", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all bits equal" in result.stdout
    assert "DIFFERENT" not in result.stdout
    assert result.stdout.count("equal") >= 4  # four table rows, every one equal


def test_cli_demo_prefix_caching_end_to_end(tmp_path: Path) -> None:
    """The README's first command: every warm scenario (DRAM, disk, shared FS, store node,
    disaggregated decode, agent session, restart) serves output equal to the cold one, and the
    demo leaves nothing behind: its pool goes to a directory of this test's in /dev/shm
    (--shm-dir), its scratch to the test's TMPDIR, and both must be empty at the end (what other
    processes do in /dev/shm meanwhile is none of this test's business). Run with --json (one
    demo run for both): the table and the progress go to stderr, one JSON object to stdout."""
    shm = Path("/dev/shm") / run_name("demo")
    shm.mkdir()
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    try:
        result = _run(
            "demo", "--tokens", "512", "--new-tokens", "4", "--json", "--shm-dir", str(shm),
            timeout=180, tmpdir=scratch,
        )  # fmt: skip
        left = sorted(p.name for p in shm.iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all outputs equal" in result.stderr
    lines = result.stderr.splitlines()
    rows = [line for line in lines if line.endswith(" equal") and not line.startswith("all")]
    assert len(rows) == 7 and "DIFFERENT" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["prompt_tokens"] == 512
    table = report["rows"]
    assert table[0]["scenario"] == "cold prefill" and table[0]["matches"] is None
    assert len(table) == 8 and all(r["matches"] is True for r in table[1:])
    assert left == [], f"the demo left {left} in its --shm-dir"
    assert list(scratch.iterdir()) == [], "the demo left files in its TMPDIR"


def test_cli_usage_errors() -> None:
    result = _run("nonsense")
    assert result.returncode == 2 and "usage: tpusync" in result.stderr  # issue 20: stderr
    assert _run("--help").returncode == 0
