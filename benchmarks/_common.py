"""Shared helpers for tpusync's benchmarks: timing, the memory-copy limit, tables, JSON."""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def settle(timeout_s: float = 300.0) -> None:
    """Waits until the CPU device pools made so far are backed by huge pages (tpusync collapses
    them on a background thread after creation), so that no timing runs beside it."""
    from tpusync.memory import huge_pages

    if not huge_pages.wait_until_idle(timeout_s):
        print(f"note: huge-page collapsing still running after {timeout_s:g} s", flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values)


class MemcpyLimit:
    """``np.copyto`` between two touched buffers, one thread per core, each its own slice: the
    memory-copy limit every host-side figure is compared with."""

    def __init__(self, nbytes: int, threads: int | None = None) -> None:
        self.threads = threads or len(os.sched_getaffinity(0))
        self.src = np.ones(nbytes, dtype=np.uint8)
        self.dst = np.ones(nbytes, dtype=np.uint8)  # touched: no page faults in the loop
        bounds = np.linspace(0, nbytes, self.threads + 1).astype(np.int64) // 4096 * 4096
        bounds[-1] = nbytes
        self.slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        self.pool = ThreadPoolExecutor(self.threads)

    def copy(self) -> None:
        list(self.pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), self.slices))

    def close(self) -> None:
        self.pool.shutdown()


def fio_gbps(
    directory: str,
    total: int,
    block_bytes: int,
    rw: str,
    *,
    ioengine: str = "psync",
    iodepth: int = 1,
) -> float | None:
    """fio's sequential direct (O_DIRECT) ``rw`` ("read" or "write") of ``total`` bytes in
    ``block_bytes`` requests, in GB/s: the disk's limit; None where fio is not installed."""
    if shutil.which("fio") is None:
        return None
    result = subprocess.run(
        [
            "fio",
            "--name=limit",
            f"--directory={directory}",
            f"--rw={rw}",
            "--direct=1",
            f"--bs={block_bytes}",
            f"--size={total}",
            f"--ioengine={ioengine}",
            f"--iodepth={iodepth}",
            "--numjobs=1",
            "--output-format=json",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    if rw == "read":  # fio lays the file out first: gone once read
        for leftover in glob.glob(os.path.join(directory, "limit.*")):
            os.unlink(leftover)
    return json.loads(result.stdout)["jobs"][0][rw]["bw_bytes"] / 1e9


TRANSFER_BLOCK_SIZES_KIB = [64, 256, 1024, 4096, 16384]


def transfer_arguments(doc: str, json_default: str) -> Any:
    """The command line both transfer benchmarks (CPU and GPU) take."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-kib", type=int, nargs="*", default=TRANSFER_BLOCK_SIZES_KIB)
    parser.add_argument("--json", default=json_default)
    return parser.parse_args()


def print_table(headers: list[str], rows: list[list[Any]]) -> None:
    cells = [[str(h) for h in headers]] + [
        [f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def commit_of(directory: str | os.PathLike[str]) -> str:
    """The commit of the checkout holding ``directory`` (with "+dirty" when tracked files
    changed), or "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(directory), "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(directory), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Writes a benchmark's results with the machine, the time and the benchmarks' commit."""
    payload = {
        "commit": commit_of(os.path.dirname(os.path.abspath(__file__))),
        "machine": {
            "platform": platform.platform(),
            "cpus": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
        },
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **payload,
    }
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (there is a race; fine for benchmarks)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
