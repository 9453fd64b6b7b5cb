"""The physical limits benchmark figures are divided by, measured in the same run.

* Memory: a copy of one contiguous region on all cores, the best of glibc ``memcpy`` and
  non-temporal stores (one stream, or four pages interleaved), timed in C between barriers so
  that no thread start or dispatch is in it (:class:`MemoryLimit`); ``np.copyto`` on a thread
  per core is shown beside it, never used as the limit.
* TCP within a host: one sender and one receiver thread per stream over loopback, in C
  (:func:`loopback_tcp`), the best of a few chunk and send-buffer settings; beside it one
  iperf3 process per stream (:class:`Iperf3PerStream`).
* Disk: fio with ``O_DIRECT`` from huge-page buffers, the tier's own parallelism, the best of
  iodepth 1, 4 and 16 (:func:`disk_fio`).

If a product figure beats its limit, the limit is wrong: fix the limit, never the figure.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tpusync._native import limits as _limits
from tpusync._src.bench.common import free_port, median, stop_process
from tpusync._src.bench.cores import SplitEnds
from tpusync._src.memory.copy_limit import LimitResult, MemoryLimit
from tpusync.errors import InvalidArgumentError

__all__ = [
    "Iperf3PerStream",
    "LimitResult",
    "MemoryLimit",
    "TcpLimit",
    "disk_fio",
    "loopback_tcp",
    "reserved_huge_pages",
]

# (chunk: bytes per send/recv call, SO_SNDBUF (0: autotuned), the receiver's SO_RCVLOWAT step
# (0: none)) tried for the TCP limit; the best wins. Large sends with a raised low mark are how
# tpusync's own data plane moves blocks (one stream beat a plain 1 MiB loop that way).
TCP_SETTINGS = (
    (128 << 10, 0, 0),
    (128 << 10, 256 << 10, 0),
    (1 << 20, 0, 0),
    (1 << 20, 256 << 10, 0),
    (1 << 20, 0, 256 << 10),
    (4 << 20, 0, 0),
    (4 << 20, 0, 256 << 10),
    (4 << 20, 256 << 10, 256 << 10),
)


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20}M" if nbytes >= 1 << 20 else f"{nbytes >> 10}K"


def loopback_tcp(
    streams: int,
    nbytes: int,
    *,
    repeats: int = 3,
    warm_bytes: int | None = None,
    ends: SplitEnds | None = None,
) -> LimitResult:
    """TCP over loopback with ``streams`` connections at once, ``nbytes`` in all per repeat:
    GB/s per setting ("chunk=…,sndbuf=…[,lowat=…]"), medians of ``repeats`` runs on warm
    connections. ``ends``: the senders on one CPU and the receivers on another, as between
    hosts (None: wherever the kernel puts them)."""
    cpus = (-1, -1) if ends is None else (ends.sender, ends.receiver)
    per_stream = max(1, nbytes // streams)
    warm = per_stream // 4 if warm_bytes is None else warm_bytes
    gbps: dict[str, float] = {}
    runs: dict[str, list[float]] = {}
    for chunk, sndbuf, lowat in TCP_SETTINGS:
        label = f"chunk={_size(chunk)},sndbuf={'auto' if sndbuf == 0 else _size(sndbuf)}"
        label += f",lowat={_size(lowat)}" if lowat else ""
        seconds = _limits.tcp_seconds(
            streams, per_stream, warm, chunk, sndbuf, repeats, lowat, *cpus
        )
        runs[label] = seconds
        gbps[label] = per_stream * streams / statistics.median(seconds) / 1e9
    return LimitResult(gbps, runs)


# --- disk: fio with the tier's parallelism -------------------------------------------------------

HUGE_PAGE_BYTES = 2 << 20
NR_HUGEPAGES = "/proc/sys/vm/nr_hugepages"


@contextlib.contextmanager
def reserved_huge_pages(nbytes: int) -> Iterator[bool]:
    """Reserves enough 2 MiB huge pages for ``nbytes`` of fio buffers (``--iomem=shmhuge``)
    and gives the setting back after; yields whether they were reserved (root only)."""
    try:
        with open(NR_HUGEPAGES) as f:
            before = int(f.read())
        wanted = before + -(-nbytes // HUGE_PAGE_BYTES)
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(wanted))
        with open(NR_HUGEPAGES) as f:
            got = int(f.read())
    except (OSError, ValueError):
        yield False
        return
    try:
        yield got >= wanted
    finally:
        with open(NR_HUGEPAGES, "w") as f:
            f.write(str(before))


def _fio_once(
    directory: str,
    total: int,
    block_bytes: int,
    rw: str,
    numjobs: int,
    iodepth: int,
    iomem: str,
    direct: bool = True,
) -> float:
    argv = [
        "fio", "--name=tpusync-limit", f"--directory={directory}", f"--rw={rw}",
        f"--direct={int(direct)}",
        f"--bs={block_bytes}", f"--size={max(block_bytes, total // numjobs)}",
        f"--numjobs={numjobs}", "--ioengine=libaio", f"--iodepth={iodepth}",
        f"--iomem={iomem}", "--group_reporting", "--output-format=json",
    ]  # fmt: skip
    if not direct:  # fio would drop the files' cached pages first; a buffered tier reads them
        argv.append("--invalidate=0")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"fio failed ({done.returncode}): {done.stderr.strip()[:500]}")
    job = json.loads(done.stdout)["jobs"][0]
    return job[rw]["bw_bytes"] / 1e9


def disk_fio(
    directory: str,
    total: int,
    block_bytes: int,
    rw: str,
    *,
    numjobs: int,
    iodepths: Sequence[int] = (1, 4, 16),
    direct: bool = True,
) -> LimitResult | None:
    """fio's direct (``O_DIRECT``) sequential ``rw`` ("read" or "write") of ``total`` bytes in
    ``block_bytes`` requests on ``numjobs`` jobs (the tier's I/O threads), from huge-page
    buffers where they can be reserved (as the tiers' slots are), at each iodepth: GB/s per
    "iodepth=N"; None where fio is not installed. Its files are removed. ``direct=False``: through
    the page cache, for a tier that reads and writes buffered (the shared-FS tier)."""
    if shutil.which("fio") is None:
        return None
    if rw not in ("read", "write"):
        raise InvalidArgumentError(f"rw: expected 'read' or 'write', got {rw!r}")
    gbps: dict[str, float] = {}
    # fio rounds each job's buffer up and aligns it: room for twice the bytes and a page more
    buffers = numjobs * (2 * max(iodepths) * block_bytes + HUGE_PAGE_BYTES)
    try:
        with reserved_huge_pages(buffers) as huge:
            iomem = "shmhuge" if huge else "malloc"
            for depth in iodepths:
                try:
                    value = _fio_once(
                        directory, total, block_bytes, rw, numjobs, depth, iomem, direct
                    )
                except RuntimeError:
                    if iomem == "malloc":
                        raise
                    iomem = "malloc"  # the reserved pages were not enough: say what ran
                    value = _fio_once(
                        directory, total, block_bytes, rw, numjobs, depth, iomem, direct
                    )
                gbps[f"iodepth={depth},iomem={iomem}"] = value
    finally:
        for leftover in glob.glob(os.path.join(directory, "tpusync-limit.*")):
            os.unlink(leftover)
    return LimitResult(gbps)


# --- TCP: one iperf3 process per stream ----------------------------------------------------------


class Iperf3PerStream:
    """``streams`` iperf3 servers on loopback, one client process per stream run at once (the
    iperf3 3.12 that Debian ships runs all ``-P`` streams on one thread, so ``-P`` is no limit).
    Use as a context manager; the servers are stopped by pid."""

    def __init__(self, streams: int) -> None:
        if shutil.which("iperf3") is None:
            raise FileNotFoundError("iperf3 is not installed (apt-get install iperf3)")
        self.streams = streams
        self.ports = [free_port() for _ in range(streams)]
        self._servers = [
            subprocess.Popen(
                ["iperf3", "-s", "-p", str(port), "-B", "127.0.0.1"],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for port in self.ports
        ]

    def gbps(
        self,
        nbytes: int,
        options: Sequence[str] = (),
        tries: int = 20,
        ends: SplitEnds | None = None,
    ) -> float:
        """GB/s of one run: ``nbytes`` in all, each client its share over one connection.
        ``ends``: the sending clients on one CPU, the receiving servers on another."""
        if ends is not None:
            options = [*options, "-A", f"{ends.sender},{ends.receiver}"]
        for attempt in range(tries):  # the first tries may find a server not listening yet
            clients = [
                subprocess.Popen(
                    [
                        "iperf3",
                        "-c",
                        "127.0.0.1",
                        "-p",
                        str(port),
                        "-P",
                        "1",
                        "-J",
                        "-n",
                        str(nbytes // self.streams),
                        *options,
                    ],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for port in self.ports
            ]
            reports = []
            for client in clients:
                try:
                    out, _ = client.communicate(timeout=300)
                except subprocess.TimeoutExpired:
                    client.kill()
                    client.communicate()
                    raise
                try:
                    reports.append(json.loads(out))
                except json.JSONDecodeError:
                    reports.append({"error": out.strip()[:200]})
            if not any("error" in r for r in reports):
                got = [r["end"]["sum_received"] for r in reports]
                return sum(g["bytes"] for g in got) / max(g["seconds"] for g in got) / 1e9
            if attempt + 1 == tries:
                raise RuntimeError(f"iperf3 failed: {[r.get('error') for r in reports]}")
            time.sleep(0.2)
        raise AssertionError("unreachable")

    def close(self) -> None:
        for server in self._servers:
            stop_process(server)

    def __enter__(self) -> Iperf3PerStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# iperf3 as tpusync runs within a host: a 256 KiB socket buffer (iperf3 sets both ends') and
# 1 MiB writes, beside its defaults; the limit takes the better.
IPERF3_TUNED = ("-w", "256K", "-l", "1M")
IPERF3_OPTIONS = {"": (), " " + " ".join(IPERF3_TUNED): IPERF3_TUNED}


class TcpLimit:
    """The TCP limit within this host for ``connections`` streams: per sample, the C sender and
    receiver of each chunk/buffer setting once, and one iperf3 process per stream with each
    option set once; :meth:`result` gives the best median and its method. ``ends``: each end
    pinned to its own CPU, as between hosts (None: not pinned)."""

    def __init__(
        self,
        stack: contextlib.ExitStack,
        connections: int,
        nbytes: int,
        ends: SplitEnds | None = None,
    ) -> None:
        self.connections = connections
        self.nbytes = nbytes
        self.ends = ends
        self.iperf: Iperf3PerStream | None = None
        if shutil.which("iperf3") is not None:
            self.iperf = stack.enter_context(Iperf3PerStream(connections))
        self.runs: dict[str, list[float]] = {}

    def _label(self, suffix: str) -> str:
        c = self.connections
        return f"iperf3 {c} stream{'s' if c > 1 else ''}{suffix}"

    def sample(self, tries: int = 1) -> None:
        found = loopback_tcp(self.connections, self.nbytes, repeats=3, ends=self.ends)
        moved = self.nbytes // self.connections * self.connections  # what loopback_tcp sends
        for label, seconds in found.runs.items():  # the best of 3: what the machine can do
            self.runs.setdefault(f"C tcp {label}", []).append(moved / min(seconds) / 1e9)
        if self.iperf is not None:
            for suffix, options in IPERF3_OPTIONS.items():
                gbps = self.iperf.gbps(self.nbytes, options, tries=tries, ends=self.ends)
                self.runs.setdefault(self._label(suffix), []).append(gbps)

    def result(self) -> dict[str, Any]:
        medians = {k: median(v) for k, v in self.runs.items()}
        best = max(medians, key=medians.__getitem__)
        found: dict[str, Any] = {
            "limit_gbps": medians[best],
            "limit_method": best,
            "gbps_by_method": medians,
        }
        if self.ends is not None:
            found["ends"] = self.ends.describe()
        return found
