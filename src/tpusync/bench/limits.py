"""The physical limits benchmark figures are divided by, measured in the same run.

* Memory: a copy of one contiguous region on all cores, the best of glibc ``memcpy`` and
  non-temporal stores (one stream, or four pages interleaved), timed in C between barriers so
  that no thread start or dispatch is in it (:class:`MemoryLimit`); ``np.copyto`` on a thread
  per core is shown beside it, never used as the limit.
* TCP within a host: one sender and one receiver thread per stream over loopback, in C
  (:func:`loopback_tcp`), the best of a few chunk and send-buffer settings.

If a product figure beats its limit, the limit is wrong: fix the limit, never the figure.
"""

from __future__ import annotations

import itertools
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from tpusync._native import limits as _limits
from tpusync.errors import InvalidArgumentError

__all__ = ["LimitResult", "MemoryLimit", "loopback_tcp"]

STREAMING_METHODS = ("stream", "stream_pages")


@dataclass
class LimitResult:
    """A limit's medians per method in GB/s; :attr:`gbps` is the best of them and
    :attr:`method` the one that gave it."""

    gbps_by_method: dict[str, float]
    runs: dict[str, list[float]] = field(default_factory=dict)

    @property
    def method(self) -> str:
        return max(self.gbps_by_method, key=self.gbps_by_method.__getitem__)

    @property
    def gbps(self) -> float:
        return self.gbps_by_method[self.method]


def _huge_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Anonymous memory asking for transparent huge pages (as tpusync's DRAM pools do), every
    page touched: the limit runs on memory as good as the product's."""
    size = max(nbytes, 1)
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(region, dtype=np.uint8, count=nbytes)
    return region, array


class MemoryLimit:
    """The memory-copy limit for ``nbytes``: one contiguous region to another, on ``threads``
    threads (default: every core this process may run on).

    :meth:`sample` times each method once (so that calls alternate with the figures they
    bound); :meth:`result` gives the medians so far and the best method."""

    def __init__(self, nbytes: int, threads: int | None = None, *, seed: int = 0) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 1:
            raise InvalidArgumentError(
                f"nbytes: expected a positive number of bytes, got {nbytes!r}"
            )
        self.nbytes = nbytes
        self.threads = threads or len(os.sched_getaffinity(0))
        self._src_region, self.src = _huge_buffer(nbytes)
        self._dst_region, self.dst = _huge_buffer(nbytes)
        rng = np.random.default_rng(seed)
        self.src[:] = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
        self.dst[:] = 1  # touched: no page faults in a timed copy
        self.methods = ["memcpy", *(STREAMING_METHODS if _limits.have_streaming() else ())]
        bounds = np.linspace(0, nbytes, self.threads + 1).astype(np.int64) // 4096 * 4096
        bounds[-1] = nbytes
        self._slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        self._pool = ThreadPoolExecutor(self.threads)
        self._runs: dict[str, list[float]] = {m: [] for m in [*self.methods, "np.copyto"]}

    def sample(self, repeats: int = 1) -> None:
        """Times every method ``repeats`` times (the best repeat counts: the limit is what the
        machine can do) and ``np.copyto`` once."""
        for method in self.methods:
            seconds = _limits.copy_seconds(self.dst, self.src, self.threads, method, repeats)
            self._runs[method].append(min(seconds))
        start = time.perf_counter()
        list(self._pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), self._slices))
        self._runs["np.copyto"].append(time.perf_counter() - start)

    def verify(self) -> bool:
        """Whether the last copy left ``dst`` equal to ``src`` (a limit that copies wrongly
        measures nothing)."""
        return bool(np.array_equal(self.dst, self.src))

    def result(self) -> LimitResult:
        """Medians so far; ``np.copyto`` is reported but never chosen as the limit."""
        if not self._runs["memcpy"]:
            raise InvalidArgumentError("MemoryLimit.result: no samples yet; call sample() first")
        gbps = {m: self.nbytes / statistics.median(t) / 1e9 for m, t in self._runs.items() if t}
        best = {m: g for m, g in gbps.items() if m != "np.copyto"}
        return LimitResult(best, {m: list(t) for m, t in self._runs.items()})

    def copyto_gbps(self) -> float:
        """``np.copyto``'s median GB/s: shown beside the limit, the ratio the old tables used."""
        return self.nbytes / statistics.median(self._runs["np.copyto"]) / 1e9

    def close(self) -> None:
        self._pool.shutdown()
        del self.src, self.dst
        self._src_region.close()
        self._dst_region.close()


# Chunks (bytes per send/recv call) and send buffers tried for the TCP limit: the best wins.
TCP_CHUNKS = (128 << 10, 1 << 20)
TCP_SNDBUFS = (0, 256 << 10)  # 0: autotuned


def loopback_tcp(
    streams: int, nbytes: int, *, repeats: int = 3, warm_bytes: int | None = None
) -> LimitResult:
    """TCP over loopback with ``streams`` connections at once, ``nbytes`` in all per repeat:
    GB/s per setting ("chunk=…,sndbuf=…"), medians of ``repeats`` runs on warm connections."""
    per_stream = max(1, nbytes // streams)
    warm = per_stream // 4 if warm_bytes is None else warm_bytes
    gbps: dict[str, float] = {}
    runs: dict[str, list[float]] = {}
    for chunk, sndbuf in itertools.product(TCP_CHUNKS, TCP_SNDBUFS):
        label = f"chunk={chunk >> 10}K,sndbuf={'auto' if sndbuf == 0 else f'{sndbuf >> 10}K'}"
        seconds = _limits.tcp_seconds(streams, per_stream, warm, chunk, sndbuf, repeats)
        runs[label] = seconds
        gbps[label] = per_stream * streams / statistics.median(seconds) / 1e9
    return LimitResult(gbps, runs)
