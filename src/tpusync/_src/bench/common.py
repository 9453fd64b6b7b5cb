"""What every benchmark shares: timing, summaries (median and range), tables that flag a beaten
limit, and the results scheme ``<results>/<bench>/<commit>-<machine>.json``."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tpusync._src.memory import huge_pages
from tpusync._src.memory.device_pool import DevicePool

__all__ = [
    "LIMIT_BEATEN",
    "Run",
    "commit_of",
    "default_results_dir",
    "format_table",
    "free_port",
    "listen_port",
    "machine_name",
    "median",
    "print_table",
    "result_path",
    "settle",
    "spread",
    "stale_install",
    "stop_process",
    "timed",
]

LIMIT_BEATEN = "limit beaten: the limit is wrong"
PACKAGE_DIR = Path(__file__).resolve().parent


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def spread(values: Sequence[float], digits: int = 2) -> str:
    """``"median (min-max)"`` of ``values``: each row's figure with its range."""
    if not values:
        return "-"
    return f"{median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def settle(timeout_s: float = 300.0) -> None:
    """Waits until the CPU device pools made so far are backed by huge pages (tpusync collapses
    them on a background thread after creation), so that no timing runs beside it."""
    if not huge_pages.wait_until_idle(timeout_s):
        print(f"note: huge-page collapsing still running after {timeout_s:g} s", flush=True)


# -- tables ----------------------------------------------------------------------------------------


def random_device_pools(
    n_arrays: int, n_blocks: int, block_bytes: int, seed: int
) -> list[DevicePool]:
    """``n_arrays`` bfloat16 device pools of random bits whose blocks together make
    ``block_bytes`` (as a model's per-layer K/V arrays do), collapsed into huge pages."""
    per_array = block_bytes // n_arrays // 2  # bf16 elements of one array's part of a block
    rng = np.random.default_rng(seed)
    pools = []
    for _ in range(n_arrays):
        bits = rng.integers(0, 2**16, size=(n_blocks, per_array), dtype=np.uint16)
        pools.append(DevicePool(jax.device_put(bits.view(jax.numpy.bfloat16))))
    settle()
    return pools


def _cell(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], limit_columns: Sequence[int] = ()
) -> str:
    """A plain-text table. ``limit_columns``: the indexes of ratio-to-limit columns; a row where
    one of them exceeds 1.0 ends with the warning :data:`LIMIT_BEATEN` (a figure cannot beat
    its physical limit: the limit was measured wrongly)."""
    cells = [[str(h) for h in headers]]
    warned = False
    for row in rows:
        line = [_cell(c) for c in row]
        beaten = [
            headers[i]
            for i in limit_columns
            if i < len(row) and isinstance(row[i], int | float) and row[i] > 1.0
        ]
        if beaten:
            warned = True
            line.append(f"!! {LIMIT_BEATEN} ({', '.join(beaten)})")
        cells.append(line)
    if warned:
        cells[0].append("warning")
    width = max(len(r) for r in cells)
    for r in cells:
        r.extend([""] * (width - len(r)))
    widths = [max(len(r[i]) for r in cells) for i in range(width)]
    lines = []
    for i, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], limit_columns: Sequence[int] = ()
) -> None:
    print(format_table(headers, rows, limit_columns), flush=True)


# -- results ---------------------------------------------------------------------------------------


def commit_of(directory: str | os.PathLike[str]) -> str:
    """The commit of the checkout holding ``directory`` (with "+dirty" when tracked files
    changed), or "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(  # the results a run writes do not make the checkout dirty
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no",
             "--", ":/", ":!/benchmarks/RESULTS.md", ":!/benchmarks/results"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


@functools.cache
def _commit() -> str:
    """The commit of the checkout holding the package, else (a wheel installed outside a
    checkout) of the checkout holding the running script (``benchmarks/*.py``), with
    "+stale" when the package runs from a wheel built from other sources than that
    checkout's (an environment not rebuilt since the last change). Once per process: the
    file name and the record of a run name the same commit."""
    source = PACKAGE_DIR
    found = commit_of(source)
    if found == "unknown" and sys.argv and sys.argv[0]:
        source = Path(sys.argv[0]).resolve().parent
        found = commit_of(source)
    checkout = _toplevel(source)
    stale = checkout is not None and stale_install(
        PACKAGE_DIR.parent, checkout, Path(sys.prefix) / INSTALLED_STAMP
    )
    if found != "unknown" and stale:
        print(f"tpusync bench: WARNING: {stale}; results go under +stale", file=sys.stderr)
        found += "+stale"
    return found


def _toplevel(directory: Path) -> Path | None:
    try:
        top = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "--show-toplevel"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return Path(top)


INSTALLED_STAMP = ".tpusync-installed"  # scripts/_engine_envs.sh: the wheel an environment has


def stale_install(installed: Path, checkout: Path, stamp: Path | None = None) -> str | None:
    """Why the package installed at ``installed`` is not built from the sources of the git
    checkout at ``checkout``, or None when it is (or ``checkout`` holds no sources, or the
    package runs from them). Where ``stamp`` names the wheel the environment installed
    (``.wheelhouse/<fingerprint>/...``, written by scripts/_engine_envs.sh), its fingerprint
    is compared with the checkout's (``scripts/_fingerprint.sh``: every source by content);
    elsewhere, the Python files by content."""
    sources = checkout / "src" / "tpusync"
    if not sources.is_dir() or sources.resolve() == installed.resolve():
        return None
    script = checkout / "scripts" / "_fingerprint.sh"
    if stamp is not None and stamp.is_file() and script.is_file():
        built = Path(stamp.read_text().strip()).parent.name
        try:
            now = subprocess.run(
                ["bash", str(script), str(checkout)],
                capture_output=True, text=True, check=True, timeout=60,
            ).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError) as exc:
            return f"the sources of {checkout} could not be fingerprinted ({exc})"
        if built != now:
            return (
                f"the installed tpusync was built from other sources than {checkout}'s (wheel "
                f"{built[:12]}, checkout {now[:12]}): rebuild the environment (scripts/test.sh "
                "or source scripts/_venv.sh) before benchmarking"
            )
        return None
    for path in sorted(sources.rglob("*.py*")):
        if path.suffix not in (".py", ".pyi") or "__pycache__" in path.parts:
            continue
        copy = installed / path.relative_to(sources)
        if not copy.is_file() or copy.read_bytes() != path.read_bytes():
            return (
                f"the installed tpusync ({installed}) differs from {path}: rebuild the "
                "environment (scripts/test.sh or source scripts/_venv.sh) before benchmarking"
            )
    return None


def machine_name() -> str:
    """A short name of this machine's kind for result files: ``cpu-2core``, ``gpu-16core``."""
    backend = jax.default_backend()
    return f"{backend}-{len(os.sched_getaffinity(0))}core"


def benchmarks_path(name: str) -> Path:
    """``benchmarks/<name>`` of the checkout this package runs from, else
    ``./tpusync-bench-<name>`` (an installed package has no checkout)."""
    checkout = PACKAGE_DIR.parents[2] / "benchmarks"
    if checkout.is_dir():
        return checkout / name
    return Path.cwd() / f"tpusync-bench-{name}"


def default_results_dir() -> Path:
    """Where results are written unless told: :func:`benchmarks_path` ``("results")``."""
    return benchmarks_path("results")


def result_path(bench: str, results_dir: str | os.PathLike[str] | None = None) -> Path:
    """Where a run of ``bench`` at this commit on this machine is written."""
    base = Path(results_dir) if results_dir is not None else default_results_dir()
    commit = _commit()
    commit = "unknown-commit" if commit == "unknown" else commit
    return base / bench / f"{commit}-{machine_name()}.json"


@dataclass
class Run:
    """One benchmark run: the load average when it started (so that a noisy machine shows in
    its results) and :meth:`write` to save them in the scheme."""

    bench: str
    load_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    started: float = field(default_factory=time.time)

    def write(self, path: str | os.PathLike[str] | None, payload: dict[str, Any]) -> Path:
        """Writes ``payload`` with the commit, date, machine and load average at start and end
        to ``path`` (default: :func:`result_path`)."""
        target = Path(path) if path else result_path(self.bench)
        record = {
            "benchmark": self.bench,
            "commit": _commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {
                "name": machine_name(),
                "platform": platform.platform(),
                "cpus": len(os.sched_getaffinity(0)),
                "python": platform.python_version(),
            },
            "load_average": {"start": list(self.load_start), "end": list(os.getloadavg())},
            "seconds_in_all": time.time() - self.started,
            **payload,
        }
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {target}", flush=True)
        return target


# -- processes -------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (there is a race; fine for benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def listen_port(host: str = "127.0.0.1") -> int:
    """A free TCP port below the kernel's ephemeral range, for a child to listen on later:
    a port from :func:`free_port` may meanwhile be handed to anyone binding port 0 (in a
    ``vllm_disagg`` run the NIXL producer's own engine took its side channel's port, and the
    engine hung at start)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    return free_port(host)


def stop_process(proc: subprocess.Popen[Any], timeout: float = 10.0) -> int:
    """Stops a child by its pid, never leaving it running: EOF on its stdin (when it has a pipe)
    and ``timeout`` to exit, then SIGTERM and ``timeout``, then SIGKILL. Returns its exit code."""
    if proc.poll() is not None:
        return proc.returncode
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(timeout)
    return proc.wait()
