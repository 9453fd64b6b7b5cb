"""The memory-copy limit: a copy of one contiguous region to another on all cores, the best of
glibc ``memcpy`` and non-temporal stores (one stream, four pages interleaved, or four 12 KiB
streams loaded together as the fused copy + checksum reads), timed in C
between barriers so that no thread start or dispatch is in it. ``np.copyto`` on a thread per
core is measured beside it and never used as the limit. The demo and ``tpusync bench`` divide
their host-side figures by it.

With ``cold=True`` the caches are emptied before each timed copy: for a region that fits in the
last-level cache, back-to-back copies read a source the previous copy left in the cache, which
a load of blocks written long ago (a KV hit after model steps that streamed the weights through
the cache) never finds there. The caches are emptied by reading, not writing, a buffer four
times the last-level cache: written, it left the cache full of dirty lines that the timed copy
then wrote back, a cost no load of clean blocks pays."""

from __future__ import annotations

import itertools
import mmap
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tpusync._native import core as _core
from tpusync.errors import InvalidArgumentError

__all__ = [
    "STREAMING_METHODS",
    "CacheEmptier",
    "LimitResult",
    "MemoryLimit",
    "last_level_cache_bytes",
    "memory_limit_gbps",
]

STREAMING_METHODS = ("stream", "stream_pages", "stream_four")


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


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (sysfs), or 64 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=64 << 20)


class CacheEmptier:
    """Empties the CPU caches when called, by reading (not writing: see the module's docstring)
    a buffer of four times the last-level cache, as before a timed copy of blocks that were
    written long ago."""

    def __init__(self) -> None:
        self._buffer = np.ones(4 * last_level_cache_bytes() // 8, np.uint64)

    @property
    def nbytes(self) -> int:
        return int(self._buffer.nbytes)

    def __call__(self) -> None:
        int(self._buffer.sum())


class MemoryLimit:
    """The memory-copy limit for ``nbytes``: one contiguous region to another, on ``threads``
    threads (default: every core this process may run on); ``cold``: the caches emptied before
    each timed copy (see the module's docstring).

    :meth:`sample` times each method once (so that calls alternate with the figures they
    bound); :meth:`result` gives the medians so far and the best method."""

    def __init__(
        self, nbytes: int, threads: int | None = None, *, seed: int = 0, cold: bool = False
    ) -> None:
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
        self.methods = ["memcpy", *(STREAMING_METHODS if _core.have_streaming() else ())]
        bounds = np.linspace(0, nbytes, self.threads + 1).astype(np.int64) // 4096 * 4096
        bounds[-1] = nbytes
        self._slices = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]
        self._pool = ThreadPoolExecutor(self.threads)
        self._runs: dict[str, list[float]] = {m: [] for m in [*self.methods, "np.copyto"]}
        self._evict = CacheEmptier() if cold else None

    def _empty_caches(self) -> None:
        if self._evict is not None:
            self._evict()

    def sample(self, repeats: int = 1) -> None:
        """Times every method ``repeats`` times (the best repeat counts: the limit is what the
        machine can do) and ``np.copyto`` once."""
        for method in self.methods:
            if self._evict is None:
                seconds = _core.copy_seconds(self.dst, self.src, self.threads, method, repeats)
            else:
                seconds = []
                for _ in range(repeats):
                    self._empty_caches()
                    seconds += _core.copy_seconds(self.dst, self.src, self.threads, method, 1)
            self._runs[method].append(min(seconds))
        self._empty_caches()
        start = time.perf_counter()
        list(self._pool.map(lambda s: np.copyto(self.dst[s], self.src[s]), self._slices))
        self._runs["np.copyto"].append(time.perf_counter() - start)

    def verify(self) -> bool:
        """Whether every method copies ``src`` into ``dst`` exactly (a limit that copies wrongly
        measures nothing): each starts from a cleared ``dst``."""
        for method in self.methods:
            self.dst[:] = 0
            _core.copy_seconds(self.dst, self.src, self.threads, method, 1)
            if not np.array_equal(self.dst, self.src):
                return False
        return True

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
        self._evict = None
        del self.src, self.dst
        self._src_region.close()
        self._dst_region.close()


def memory_limit_gbps(nbytes: int, repeats: int = 5) -> LimitResult:
    """The limit for ``nbytes`` measured now: ``repeats`` samples of every method."""
    limit = MemoryLimit(nbytes)
    try:
        for _ in range(repeats):
            limit.sample(repeats=3)
        return limit.result()
    finally:
        limit.close()
