"""The `tpusync` command's conventions, on the real command run as a subprocess:
``--version``; an unknown command named on stderr; a reader that closes the pipe early; port
ranges; ``shm --dir`` before or after the action; errors that name flags; help that shows
defaults; ``--json`` wherever a command prints a table. Exit codes: 0 done, 2 a usage error,
1 a runtime failure."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import tpusync
from tpusync._src import cli
from tpusync._src.cli_common import flag_message
from tpusync._src.testing.processes import stop_process
from tpusync.tiers import HostPool, PoolLayout

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
COMMAND = [sys.executable, "-m", "tpusync"]
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, Linux (named in the module from Python 3.12 on)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*COMMAND, *args], capture_output=True, text=True, timeout=timeout, env=ENV, check=False
    )


def secret_file(tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


def make_pool(shm_dir: Path, name: str, rng: np.random.Generator, model: str = "cli-test") -> None:
    """A named pool with 2 of its 3 slots used, whose owner (this process) has closed it."""
    data = rng.integers(1, 2**31, size=(4, 8, 128), dtype=np.int32).view(np.float32)
    pools = [tpusync.DevicePool(jax.device_put(data))]
    pool = HostPool(PoolLayout.from_pools(model, pools), 3, name=name, shm_dir=str(shm_dir))
    try:
        pool.put_from_device([rng.bytes(16), rng.bytes(16)], pools, [0, 1])
    finally:
        pool.close()


def assert_quiet_stderr(stderr: str) -> None:
    for word in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert word not in stderr, stderr[-2000:]


# -- --version -------------------------------------------------------------------------------


def test_version() -> None:
    result = run("--version")
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"tpusync {tpusync.__version__}\n",
        "",
    )


def test_version_short_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["-V"]) == 0
    assert capsys.readouterr() == (f"tpusync {tpusync.__version__}\n", "")


# What the `tpusync` console script runs (python -m tpusync runs the same through __main__).
CONSOLE_SCRIPT = "import sys; from tpusync._src.cli import main; sys.exit(main())"


@pytest.mark.parametrize("argv", [["--version"], ["version"], ["--help"], ["help"], ["-h"]])
def test_version_and_help_import_no_jax(argv: list[str]) -> None:
    """They answer in about 0.1 s (issue 54: every call imported JAX, ~2 s of CPU): nothing
    of JAX or numpy is imported (-X importtime lists every module imported)."""
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", CONSOLE_SCRIPT, *argv],
        capture_output=True, text=True, timeout=60, env=ENV, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    modules = {line.rpartition("|")[2].strip() for line in done.stderr.splitlines()}
    assert "tpusync._src.cli" in modules  # -X importtime listed the imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "numpy"))
    assert heavy == [], heavy
    expected = f"tpusync {tpusync.__version__}" if "version" in argv[0] else "usage: tpusync"
    assert done.stdout.startswith(expected)


def test_help_command_shows_a_commands_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["help", "shm"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: tpusync shm")
    assert cli.main(["help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tpusync") and "help     this text" in out
    assert cli.main(["help", "nonsense"]) == 2
    assert "unknown command 'nonsense'" in capsys.readouterr().err


def test_import_tpusync_is_lazy_and_keeps_its_names() -> None:
    """`import tpusync` imports no JAX; the public names import it on first use, and
    tpusync.transfer and tpusync.info are the functions whatever imports their modules."""
    script = (
        "import sys, tpusync; assert 'jax' not in sys.modules, 'jax imported'; "
        "import tpusync._src.transfer.api, tpusync._src.info, tpusync.kv; "
        "from tpusync._src.memory.device_pool import DevicePool; "
        "assert tpusync.transfer is sys.modules['tpusync._src.transfer'].transfer; "
        "assert tpusync.info is sys.modules['tpusync._src.info'].info; "
        "assert tpusync.DevicePool is DevicePool and 'transfer_batch' in dir(tpusync); "
        "assert sorted(n for n in tpusync.__all__ if not hasattr(tpusync, n)) == []; "
        "print('ok')"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert done.stdout == "ok\n", done.stderr[-2000:]


# -- an unknown command ----------------------------------------------------------------------


def test_unknown_command_is_named_on_stderr_with_usage_exit_2() -> None:
    result = run("nonsense")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("usage: tpusync")
    assert result.stderr.rstrip().endswith(
        "tpusync: error: unknown command 'nonsense' "
        "(choose from info, demo, shm, serve, health, bench)"
    )


def test_unknown_option_and_no_command_are_usage_errors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: tpusync")
    assert err.rstrip().endswith(
        "tpusync: error: unknown option '--bogus' "
        "(choose from info, demo, shm, serve, health, bench)"
    )
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: tpusync")
    assert err.rstrip().endswith("tpusync: error: a command is required")
    assert cli.main(["--help"]) == 0  # asked for: stdout, exit 0, with the exit codes
    out, err = capsys.readouterr()
    assert out.startswith("usage: tpusync") and err == ""
    assert "Exit codes: 0 done, 2 a usage error,\n1 a runtime failure." in out


# -- a reader that stops early (`tpusync info | head`) ----------------------------------------


def test_broken_pipe_info_closed_before_it_writes_exits_0_quietly() -> None:
    """The reader is gone before `tpusync info` writes a byte: every write fails with EPIPE,
    including the interpreter's last flush."""
    child = subprocess.Popen(
        [*COMMAND, "info"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    assert child.stdout is not None
    child.stdout.close()  # the child is still importing: it has written nothing yet
    try:
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert child.returncode == 0, err[-2000:]
    assert_quiet_stderr(err)


def test_broken_pipe_after_one_line_exits_0_quietly(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """`tpusync shm list | head -1` over a listing far larger than the pipe: the reader takes one
    line and closes its end while the command is still writing."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    for i in range(1500):  # damaged entries: a line each, cheap to make
        (shm_dir / f"tpusync-junk-{i:04d}.pool").write_bytes(rng.bytes(64))
    read_end, write_end = os.pipe()
    fcntl.fcntl(read_end, F_SETPIPE_SZ, 4096)  # one page: the command blocks while writing
    child = subprocess.Popen(
        [*COMMAND, "shm", "list", "--dir", str(shm_dir)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        env=ENV,
    )
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as reader:
            first = reader.readline()
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    assert first.startswith(b"name ")
    assert child.returncode == 0, err[-2000:]
    assert_quiet_stderr(err)


# -- ports -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value", [("--port", "99999"), ("--port", "-1"), ("--registry-port", "70000")]
)
def test_port_out_of_range_is_a_usage_error_naming_the_flag(
    tmp_path: Path, flag: str, value: str
) -> None:
    result = run("serve", "--secret-file", secret_file(tmp_path), flag, value, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert (
        f"tpusync serve: error: argument {flag}: expected a TCP port from 0 to 65535 "
        f"(0: a free one), got '{value}'" in result.stderr
    )
    assert_quiet_stderr(result.stderr)


# -- shm --dir before or after the action ------------------------------------------------------


@pytest.mark.parametrize("where", ["before", "after", "both"])
def test_shm_dir_before_or_after_the_action(
    tmp_path: Path, rng: np.random.Generator, where: str
) -> None:
    make_pool(tmp_path, "where", rng)
    here = ["--dir", str(tmp_path)]
    elsewhere = ["--dir", str(tmp_path / "absent")]
    listing = {
        "before": ["shm", *here, "list"],
        "after": ["shm", "list", *here],
        "both": ["shm", *elsewhere, "list", *here],  # the later one counts
    }[where]
    listed = run(*listing)
    assert listed.returncode == 0, listed.stderr
    assert "where" in listed.stdout and "2/3" in listed.stdout
    removal = {
        "before": ["shm", *here, "remove", "where"],
        "after": ["shm", "remove", "where", *here],
        "both": ["shm", *elsewhere, "remove", *here, "where"],
    }[where]
    removed = run(*removal)
    assert removed.returncode == 0, removed.stderr
    assert not (tmp_path / "tpusync-where.pool").exists()


# -- errors name the flags -------------------------------------------------------------------


def test_library_argument_names_are_written_as_flags() -> None:
    flags = {"dram_bytes": "--dram", "shm_dir": "--shm-dir", "name": "--name"}
    assert flag_message("dram_bytes: 100.0 TiB asked for", flags) == "--dram: 100.0 TiB asked for"
    assert flag_message("name: bad; see shm_dir", flags) == "--name: bad; see --shm-dir"
    assert flag_message("other_arg: kept", flags) == "other_arg: kept"


@pytest.mark.parametrize(
    "case",
    ["shm bad name", "shm absent pool", "shm dir is a file", "serve tls files", "demo repeats"],
)
def test_errors_name_the_flag_with_the_exit_code_of_their_kind(tmp_path: Path, case: str) -> None:
    """Usage errors exit 2, runtime failures 1; the message names the flag or the metavar, never
    the library's Python argument name."""
    if case == "shm bad name":
        args, code = ["shm", "remove", "../x", "--dir", str(tmp_path)], 1
        expected = "tpusync shm remove: NAME: '../x' is not a pool name"
    elif case == "shm absent pool":
        args, code = ["shm", "remove", "absent", "--dir", str(tmp_path)], 1
        expected = f"tpusync shm remove: NAME: no pool 'absent' in {tmp_path}"
    elif case == "shm dir is a file":
        (tmp_path / "file").write_bytes(secrets.token_bytes(16))
        args, code = ["shm", "list", "--dir", str(tmp_path / "file")], 2
        expected = f"tpusync shm: error: --dir: {tmp_path / 'file'} is not a directory"
    elif case == "serve tls files":
        (tmp_path / "cert.pem").write_text("not a certificate")
        cert = str(tmp_path / "cert.pem")
        args = ["serve", "--secret-file", secret_file(tmp_path), "--tls-cert", cert]
        args += ["--tls-key", cert]
        code, expected = 2, f"tpusync serve: --tls-cert, --tls-key: cannot load {cert} with {cert}"
    else:
        args, code = ["demo", "--transfer", "--repeats", "0"], 2
        expected = "tpusync demo --transfer: error: argument --repeats: expected an integer >= 1"
    result = run(*args, timeout=60)
    assert result.returncode == code, result.stderr[-2000:]
    assert expected in result.stderr, result.stderr[-2000:]
    assert "name:" not in result.stderr and "shm_dir" not in result.stderr
    assert_quiet_stderr(result.stderr)


# -- help shows defaults ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, defaults",
    [
        (["serve", "--help"], ["(default: 1GiB)", "(default: 127.0.0.1)", "(default: /dev/shm)"]),
        (["shm", "--help"], ["(default: /dev/shm)"]),
        (["health", "--help"], ["(default: 5.0)"]),
        (["demo", "--help"], ["(default: 8192)", "(default: 8)"]),
        (["demo", "--transfer", "--help"], ["(default: 4)", "(default: 5)"]),
    ],
)
def test_help_shows_defaults(
    capsys: pytest.CaptureFixture[str], argv: list[str], defaults: list[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in defaults:
        assert default in text, text
    assert "(default: None)" not in text and "(default: False)" not in text


# -- --json wherever a table is printed --------------------------------------------------------
# (tpusync demo --json: tests/cli/test_info_cli.py::test_cli_demo_prefix_caching_end_to_end, which
# runs the whole demo once for its table and its JSON)


def test_shm_list_json(tmp_path: Path, rng: np.random.Generator) -> None:
    make_pool(tmp_path, "listed", rng)
    (tmp_path / "tpusync-junk.pool").write_bytes(rng.bytes(64))
    result = run("shm", "list", "--json", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    pools = {p["name"]: p for p in json.loads(result.stdout)}
    assert set(pools) == {"listed", "junk"}
    listed = pools["listed"]
    assert (listed["status"], listed["used"], listed["slots"]) == ("ok", 2, 3)
    assert listed["model_id"] == "cli-test" and listed["owner_alive"] is False
    assert pools["junk"]["status"] != "ok" and pools["junk"]["error"]
    empty = tmp_path / "empty"
    empty.mkdir()
    listed = run("shm", "list", "--json", "--dir", str(empty))
    assert (listed.returncode, json.loads(listed.stdout)) == (0, [])


@pytest.mark.parametrize("action", [["list"], ["list", "--json"], ["remove"], ["remove", "x"]])
def test_shm_dir_that_does_not_exist_is_a_usage_error(tmp_path: Path, action: list[str]) -> None:
    """Not an empty listing with exit 0 (issue 54): a mistyped --dir says so."""
    absent = tmp_path / "absent"
    result = run("shm", *action, "--dir", str(absent))
    assert result.returncode == 2 and result.stdout == ""
    assert f"tpusync shm: error: --dir: {absent} does not exist" in result.stderr


def test_shm_list_columns_fit_their_content_and_sizes_have_units(
    tmp_path: Path, rng: np.random.Generator
) -> None:
    """A model id longer than any fixed column, a pool far below 1 GiB, a damaged entry: each
    column starts where its header does and is at least two spaces from the last; the size is
    in the unit that suits it (issue 54: the columns ran together, a small pool was 0.00 GiB)."""
    model = "meta-llama/Llama-3.1-70B-Instruct@rev-0123456789abcdef"
    make_pool(tmp_path, "a-pool-with-a-rather-long-name-for-the-listing", rng, model=model)
    make_pool(tmp_path, "b", rng)
    (tmp_path / "tpusync-junk.pool").write_bytes(rng.bytes(64))
    result = run("shm", "list", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    header, *lines = result.stdout.splitlines()
    assert header.split() == ["name", "owner", "model", "fingerprint", "size", "used"]
    assert len(lines) == 3

    def starts_a_column(line: str, start: int) -> bool:
        return line[start - 2 : start] == "  " and line[start] != " "

    owner, model_at, fingerprint = (header.index(w) for w in ("owner", "model", "fingerprint"))
    assert all(starts_a_column(line, owner) for line in lines), result.stdout
    pools = [line for line in lines if "damaged" not in line]
    assert len(pools) == 2
    for line in pools:
        assert starts_a_column(line, model_at) and starts_a_column(line, fingerprint), line
        number, unit = line[fingerprint:].split()[1:3]  # after the fingerprint: the size
        assert unit in ("KiB", "MiB") and float(number) >= 1, line
    assert model in result.stdout


def test_serve_json_prints_its_addresses(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [*COMMAND, "serve", "--dram", "4MiB", "--secret-file", secret_file(tmp_path), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
    )
    try:
        assert child.stdout is not None
        ready = json.loads(child.stdout.readline())
    finally:
        code = stop_process(child)
    assert set(ready) == {"address", "registry"} and ready["address"].startswith("127.0.0.1:")
    assert code == 0


def test_demo_transfer_json() -> None:
    result = run("demo", "--transfer", "--layers", "1", "--repeats", "1", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)  # stdout holds the JSON only
    assert report["ok"] is True and report["memory_limit_gbps"] > 0
    rows = report["rows"]
    assert [(r["direction"][:4], r["path"]) for r in rows] == [
        ("save", "native"),
        ("load", "native"),
        ("save", "jax"),
        ("load", "jax"),
    ]
    assert all(r["bits_equal"] and r["bytes"] > 0 and r["gbps"] > 0 for r in rows)
    assert "all bits equal" in result.stderr  # the human lines moved to stderr
