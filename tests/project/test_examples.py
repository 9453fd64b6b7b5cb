"""The programs in examples/ run as they are and check their own results; the docs quote them.

Each example runs as a child process (``sys.executable``, in a scratch working directory, with
TMPDIR there), stopped by its process group's id if it runs past its timeout. It must exit 0,
print the result it claims, and leave nothing behind in its TMPDIR or in /dev/shm. The examples
keep what they put in /dev/shm in temporary directories (``tempfile``), which here get a prefix of
this test's, so the check looks at the test's own names only: other processes make and remove
files in /dev/shm meanwhile.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from paths import REPO
from run_names import run_entries, run_name

import tpusync.kv
from tpusync._src.serve import read_secret
from tpusync.errors import InvalidArgumentError
from tpusync.kv import load_secret

EXAMPLES = REPO / "examples"
TIMEOUT_S = 90.0  # each takes seconds; a loaded 2-core machine gets room

# example -> the line it prints when its checks pass
CLAIMS = {
    "transfer.py": "bytes equal",
    "kv_store.py": "outputs equal",
    "host_tiers.py": "bytes equal",
    "cluster.py": "outputs equal",
    "store_node.py": "outputs equal",
    "weight_sync.py": "weights equal",
}


def _child_env(work: Path) -> dict[str, str]:
    env = dict(os.environ, TMPDIR=str(work), JAX_PLATFORMS="cpu")
    if env.get("PYTHONPATH"):  # a relative entry (PYTHONPATH=src) as this process resolves it
        entries = env["PYTHONPATH"].split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in entries if e)
    return env


# Runs the example as `python examples/NAME` does (as __main__, its folder first on sys.path),
# with tempfile's default prefix set to the first argument.
_WITH_PREFIX = (
    "import runpy, sys, tempfile; tempfile.template = sys.argv.pop(1); "
    "sys.path[0] = sys.argv[1].rpartition('/')[0]; sys.argv.pop(0); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def _run_example(name: str, work: Path, prefix: str) -> tuple[int, str, float]:
    env = _child_env(work)
    start = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-c", _WITH_PREFIX, prefix, str(EXAMPLES / name)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: children it starts are stopped too
    )
    try:
        out, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        out, _ = process.communicate(timeout=10)
        pytest.fail(f"examples/{name} ran past {TIMEOUT_S} s:\n{out}")
    return process.returncode, out, time.monotonic() - start


def test_every_example_is_tested() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(CLAIMS)


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_example_runs_and_checks_its_result(name: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    prefix = run_name(f"example-{name.removesuffix('.py')}")
    code, out, seconds = _run_example(name, work, prefix)
    assert code == 0, f"examples/{name} exited {code}:\n{out}"
    assert CLAIMS[name] in out.splitlines(), (
        f"examples/{name} did not print {CLAIMS[name]!r}:\n{out}"
    )
    assert "MISMATCH" not in out
    assert not list(work.iterdir()), f"examples/{name} left files: {list(work.iterdir())}"
    left = run_entries("/dev/shm", within=prefix)
    assert not left, f"examples/{name} left {left} in /dev/shm"
    print(f"examples/{name}: {seconds:.1f} s")


def test_readme_points_at_every_example() -> None:
    text = (REPO / "README.md").read_text()
    for name in CLAIMS:
        assert f"examples/{name}" in text


def test_load_secret_reads_the_files_tpusync_serve_reads(tmp_path: Path) -> None:
    """One documented way to load a secret: tpusync.kv.load_secret, behind --secret-file too."""
    secret = secrets.token_bytes(32)
    (tmp_path / "hex").write_text(secret.hex() + "\n")  # what the README says to generate
    (tmp_path / "raw").write_bytes(secret)
    (tmp_path / "short").write_text(secrets.token_hex(8))
    for name in ("hex", "raw", "short"):
        (tmp_path / name).chmod(0o600)  # as the README says
    for name in ("hex", "raw"):
        assert load_secret(tmp_path / name) == read_secret(str(tmp_path / name)) == secret
    with pytest.raises(InvalidArgumentError, match=r"^path: .*short holds a secret of 8 bytes"):
        load_secret(tmp_path / "short")
    with pytest.raises(InvalidArgumentError, match=r"^--secret-file: cannot read .*absent"):
        read_secret(str(tmp_path / "absent"))
    assert "load_secret" in tpusync.kv.__all__


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but - and _ dropped, spaces
    as dashes."""
    kept = "".join(c for c in heading.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def test_readme_contents_link_every_section_in_order() -> None:
    text = (REPO / "README.md").read_text()
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # a `# comment` is no heading
    sections = re.findall(r"^## (.+)$", prose, re.MULTILINE)
    contents = next(p for p in prose.split("\n\n") if p.startswith("Contents: "))
    links = re.findall(r"\[([^\]]+)\]\(#([^)]+)\)", contents)
    assert links == [(s, _github_anchor(s)) for s in sections]
    assert "come next" not in text.partition("## ")[0]  # the status line says what exists
