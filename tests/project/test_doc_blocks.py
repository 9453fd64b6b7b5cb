"""Every fenced code block in README.md and docs/**/*.md runs as written or says why not.

The convention (README.md, "Documentation code blocks", says it for writers). What decides is
the line right above the opening fence: an HTML comment there (GitHub does not show it) or none.

* No comment, language ``python``: the block runs as written. This test writes it to a file and
  runs it with the installed package in a fresh ``python`` process (``JAX_PLATFORMS=cpu``, one
  CPU device unless the block asks for more, DeprecationWarnings as errors, a private empty
  working directory and TMPDIR), which must exit 0 within ``TIMEOUT_S`` and leave nothing behind
  in TMPDIR or /dev/shm (what it writes into its working directory, as a reader's copy would, is
  removed with it). Keep such blocks to seconds: small sizes, loopback, temporary directories.
* ``<!-- runs -->`` above a ``bash`` or ``sh`` block: the same, run by ``bash -euo pipefail``
  with the installed ``tpusync`` command first on PATH. Shell blocks run only when marked so,
  since a shell block may install or start things: keep these to cheap commands such as
  ``tpusync --version``.
* No comment, language ``text``: a diagram or a program's output; never run.
* ``<!-- excerpt: examples/transfer.py -->``: the block is quoted from that file (a path from the
  repository root, in any language). The file must exist, every line of the block that is not
  blank and not a whole-line ``#`` comment must appear in it, in the same order, compared with
  surrounding whitespace stripped (so a quote cannot drift from its source), and the section the
  block is in must name the file, so a reader sees where the complete program is.
* ``<!-- not run: REASON -->``: a block that cannot run here, such as a command that installs,
  starts a server, needs vLLM or a model, or takes minutes. The reason is required and is shown
  in this test's report (``-rs``: each is a skip naming its file, line and reason).

Anything else fails, naming the file, the line and the fix: a block with another language or
none, an empty reason, a marker that is not right above a fence, an unclosed fence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from paths import REPO
from run_names import run_entries, run_name

TIMEOUT_S = 60.0  # each runnable block takes seconds; a loaded 2-core machine gets room
RUNS_UNMARKED = {"python"}
RUNS_MARKED = {"python", "bash", "sh"}  # <!-- runs -->
NEVER_RUN = {"text"}  # diagrams and output
COMMENT = {"python": "#", "bash": "#", "sh": "#", "console": "#", "toml": "#", "yaml": "#"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>excerpt|not run|runs)\s*:?(?P<arg>.*?)-->\s*$")
_ANY_MARKER = re.compile(r"^\s*<!--\s*(excerpt|not run|runs?)\b")


@dataclass(frozen=True)
class Block:
    path: Path  # the markdown file
    line: int  # of the opening fence, 1-based
    language: str
    marker: str | None  # "excerpt", "not run" or "runs"
    argument: str  # the excerpt's file or the reason
    code: str  # dedented, as a reader copies it
    section: str  # the text from the heading above the block to the next heading

    @property
    def where(self) -> str:
        return f"{_shown(self.path)}:{self.line}"


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _section(lines: list[str], headings: list[int], index: int) -> str:
    start = max((h for h in headings if h < index), default=0)
    end = min((h for h in headings if h > index), default=len(lines))
    return "\n".join(lines[start:end])


def parse(path: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of ``path`` and the problems found while reading them (file:line: fix)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    where = _shown(path)
    marked: set[int] = set()  # the lines of markers right above a fence
    spans: list[tuple[int, int, re.Match[str]]] = []  # opening, closing line, opening match
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence = opening["fence"]
        close = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((j for j in range(i + 1, len(lines)) if close.match(lines[j])), None)
        if end is None:
            problems.append(f"{where}:{i + 1}: this code fence is never closed: close it")
            break
        spans.append((i, end, opening))
        i = end + 1
    inside = {n for start, end, _ in spans for n in range(start, end + 1)}
    headings = [n for n, line in enumerate(lines) if n not in inside and line.startswith("#")]
    for i, end, opening in spans:
        body = [line.removeprefix(opening["indent"]) for line in lines[i + 1 : end]]
        marker, argument = None, ""
        above = _MARKER.match(lines[i - 1]) if i > 0 else None
        if above:
            marker, argument = above["kind"], above["arg"].strip()
            marked.add(i - 1)
        blocks.append(
            Block(
                path=path,
                line=i + 1,
                language=(opening["info"].split() or [""])[0].lower(),
                marker=marker,
                argument=argument,
                code=textwrap.dedent("\n".join(body)) + "\n",
                section=_section(lines, headings, i),
            )
        )
    for n, line in enumerate(lines):
        if _ANY_MARKER.match(line) and n not in marked and n not in inside:
            problems.append(
                f"{where}:{n + 1}: {line.strip()!r} is not a marker right above a code fence: "
                "write <!-- excerpt: PATH -->, <!-- not run: REASON --> or <!-- runs --> on "
                "the line just before the opening ``` (an unmarked python block runs)"
            )
    return blocks, problems


def _all_blocks() -> list[Block]:
    return [block for path in doc_files() for block in parse(path)[0]]


BLOCKS = _all_blocks()


def test_the_markdown_is_well_formed() -> None:
    problems = [p for path in doc_files() for p in parse(path)[1]]
    assert not problems, "\n".join(problems)


def test_blocks_are_found() -> None:
    """The parser sees the README's blocks (an empty list would pass everything below)."""
    assert sum(b.path.name == "README.md" for b in BLOCKS) >= 5
    assert any(b.path.parent.name == "docs" for b in BLOCKS)


def test_the_rules_catch_what_they_promise(tmp_path: Path) -> None:
    """A drifted excerpt, an unmarked shell block, a reasonless or stray marker all fail."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# A\n\nSee examples/transfer.py.\n\n"
        "<!-- excerpt: examples/transfer.py -->\n```python\nrng = np.random.default_rng()\n"
        "k_pool = tpusync.DevicePool(drifted)\n```\n\n"
        "```bash\nrm -rf build\n```\n\n"
        "<!-- not run: -->\n```bash\nvllm serve\n```\n\n"
        "<!-- excerpt: examples/transfer.py -->\n\n```text\nx\n```\n"
    )
    blocks, problems = parse(doc)
    assert [b.line for b in blocks] == [6, 11, 16, 22]
    assert problems == [
        f"{doc}:20: '<!-- excerpt: examples/transfer.py -->' is not a marker right above a code "
        "fence: write <!-- excerpt: PATH -->, <!-- not run: REASON --> or <!-- runs --> on the "
        "line just before the opening ``` (an unmarked python block runs)"
    ]
    expected = [
        r"not in examples/transfer.py .*DevicePool\(drifted\)",
        r"a bash block that nothing checks",
        r"needs its reason",
    ]
    for block, message in zip(blocks, expected, strict=False):
        with pytest.raises(pytest.fail.Exception, match=message):
            test_block_runs_or_says_why_not(block, tmp_path)


def _lines_to_match(block: Block) -> list[str]:
    comment = COMMENT.get(block.language)
    stripped = (line.strip() for line in block.code.splitlines())
    return [s for s in stripped if s and not (comment and s.startswith(comment))]


def check_excerpt(block: Block) -> None:
    if not block.argument:
        pytest.fail(f"{block.where}: the excerpt marker names no file: <!-- excerpt: PATH -->")
    source = REPO / block.argument
    if not source.is_file():
        pytest.fail(f"{block.where}: the excerpt's file {block.argument} does not exist")
    if block.argument not in block.section:
        pytest.fail(
            f"{block.where}: an excerpt of {block.argument}, but its section never names that "
            "file: link it near the block so a reader finds the complete program"
        )
    source_lines = [line.strip() for line in source.read_text().splitlines()]
    at = 0
    for wanted in _lines_to_match(block):
        try:
            at = source_lines.index(wanted, at) + 1
        except ValueError:
            pytest.fail(
                f"{block.where}: this line of the excerpt is not in {block.argument} (or not "
                f"in the same order): {wanted!r}; quote the file as it is, or change both"
            )


# Runs a python block as `python block.py` would (its folder first on sys.path, as __main__),
# with tempfile's default prefix set to this test's, so what it leaves in /dev/shm is found.
_WITH_PREFIX = (
    "import runpy, sys, tempfile; tempfile.template = sys.argv.pop(1); "
    "sys.path[0] = sys.argv[1].rpartition('/')[0]; sys.argv.pop(0); "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def run_block(block: Block, tmp_path: Path) -> None:
    work = tmp_path / "work"  # the block's cwd
    temp = tmp_path / "tmp"  # its TMPDIR: it must leave it empty
    work.mkdir()
    temp.mkdir()
    script = tmp_path / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(block.code)
    prefix = run_name("doc-block")
    env = dict(os.environ, TMPDIR=str(temp), JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a reader's fresh process has
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    if env.get("PYTHONPATH"):  # a relative entry (PYTHONPATH=src) as this process resolves it
        entries = env["PYTHONPATH"].split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(e) for e in entries if e)
    if block.language == "python":
        command = [sys.executable, "-W", "error::DeprecationWarning", "-c", _WITH_PREFIX]
        command += [prefix, str(script)]
    else:
        command = ["bash", "-euo", "pipefail", str(script)]
    start = time.monotonic()
    try:
        done = subprocess.run(
            command,
            cwd=work,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{block.where}: the block ran past {TIMEOUT_S} s:\n{e.output}\n{block.code}")
    seconds = time.monotonic() - start
    assert done.returncode == 0, (
        f"{block.where}: the {block.language} block exited {done.returncode}; make it run as "
        "written (define what it uses, small sizes) or mark it <!-- excerpt: PATH --> / "
        f"<!-- not run: REASON -->:\n{done.stdout}"
    )
    left = sorted(p.name for p in temp.iterdir())
    assert not left, f"{block.where}: the block left {left} in its TMPDIR"
    shm = run_entries("/dev/shm", within=prefix)
    assert not shm, f"{block.where}: the block left {shm} in /dev/shm"
    print(f"{block.where}: ran in {seconds:.1f} s")


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs_or_says_why_not(block: Block, tmp_path: Path) -> None:
    if block.marker == "excerpt":
        check_excerpt(block)
    elif block.marker == "not run":
        if len(block.argument.split()) < 2:
            pytest.fail(
                f"{block.where}: a not-run block needs its reason: "
                "<!-- not run: REASON (what it needs or does) -->"
            )
        pytest.skip(f"{block.where}: not run: {block.argument}")
    elif block.marker == "runs" and block.language not in RUNS_MARKED:
        pytest.fail(
            f"{block.where}: <!-- runs --> above a {block.language or 'no language'} block: "
            f"this test runs {sorted(RUNS_MARKED)}; mark it <!-- not run: REASON --> instead"
        )
    elif block.marker == "runs" or block.language in RUNS_UNMARKED:
        run_block(block, tmp_path)
    elif block.language not in NEVER_RUN:
        shown = block.language or "no language"
        pytest.fail(
            f"{block.where}: a {shown} block that nothing checks: on the line above its fence "
            "write <!-- runs --> (a cheap bash command), <!-- excerpt: PATH --> (quoted from "
            "PATH) or <!-- not run: REASON -->; a diagram or output is ```text"
        )
