"""Pulls that read a block server's pool file directly when the server runs on this host.

A server whose pool lives in a named /dev/shm file says so in its hello (``"local"``: the
file's path, the host's boot id and the server's uid; :func:`advertised_file`). A client on the
same boot and uid maps that file read-only once (:class:`PoolFileReader`); each pull then asks
its lease for the blocks' slots (``"slots": true``) and copies every block from its slot into
the caller's places, hashing the bytes as they are copied: a block whose checksum differs from
the lease's is not loaded, as over TCP. The lease pins the slots while they are copied and its
release must answer True, as for every pull (:mod:`tpusync._src.cluster.dataplane.leases`). No
socket carries the payload and no sender thread runs on the server: on a host with few cores
the copy no longer competes with the server's sender for them.

What is trusted: the path comes from an authenticated peer, but only a regular file of this uid
that nobody else may write, holding a pool header of the pull's layout, is mapped; the slots
the lease names are checked against that header; every byte copied is checked against the
lease's checksums. A peer gains nothing this way that it could not do over TCP, and another
user can neither plant the file nor change it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpusync._native import core as _core
from tpusync._src.engines import native
from tpusync._src.tiers.blocks import slot_checksums
from tpusync._src.tiers.dram.shm_admin import header_of_descriptor
from tpusync._src.tiers.dram.slot_pages import SlotPages
from tpusync._src.tiers.files import open_file
from tpusync._src.tiers.layout import PoolLayout
from tpusync._src.tiers.scatter import Scatter
from tpusync.errors import PeerUnavailableError, PoolFormatError, TpuSyncError

__all__ = ["PoolFileReader", "advertised_file", "boot_id", "lease_slots", "whole_slots"]

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096
POOL_FILE = re.compile(r"tpusync-[A-Za-z0-9._-]+\.pool")  # a named pool's file, nothing else
MAX_COPY_THREADS = 8  # a pull's copy is memory-bound: a few threads fill the bandwidth
# madvise(MADV_POPULATE_READ) (Linux 5.14); Python 3.11's mmap module has no name for it
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# How much of a pool file :meth:`PoolFileReader.warm` maps ahead (page tables cost 1/512 of it);
# slots beyond are mapped when first read.
WARM_MAX_BYTES = 16 << 30
WARM_STEP_BYTES = 4 << 20  # mapped per step, the lock released between steps
# Copied by :meth:`PoolFileReader.land` between looks at whether the reader is being closed,
# so that closing the client cuts a long copy short (as it cuts a TCP receive).
LAND_WINDOW_BYTES = 256 << 20


_copy_threads: ThreadPoolExecutor | None = None
_copy_threads_lock = threading.Lock()


def _forget_copy_threads() -> None:
    global _copy_threads, _copy_threads_lock
    _copy_threads, _copy_threads_lock = None, threading.Lock()  # threads do not survive a fork


os.register_at_fork(after_in_child=_forget_copy_threads)


def _copy_pool() -> ThreadPoolExecutor:
    """The copy threads every reader of this process shares (a client of many servers would
    hold a pool per server otherwise)."""
    global _copy_threads
    with _copy_threads_lock:
        if _copy_threads is None:
            _copy_threads = ThreadPoolExecutor(
                MAX_COPY_THREADS - 1, thread_name_prefix="tpusync-file-read"
            )
        return _copy_threads


def boot_id() -> str:
    """This host's boot id: a pool file is read directly only by a reader on the same boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def advertised_file(pool: Any) -> dict[str, Any] | None:
    """What a server's hello says of ``pool``'s file for readers on this host (None when the
    pool has no file: an anonymous pool is read over TCP only). The file's device and inode
    let a reader in another mount namespace (a container of the same host) tell its own file
    of that name from the server's."""
    path, fd = getattr(pool, "path", None), getattr(pool, "_fd", -1)
    if path is None or not isinstance(fd, int) or fd < 0:
        return None
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return {
        "path": os.path.abspath(path),
        "boot_id": boot_id(),
        "uid": os.geteuid(),
        "dev": info.st_dev,
        "ino": info.st_ino,
    }


@dataclass
class _Mapped:
    identity: tuple[int, int, int]  # st_dev, st_ino, st_size of the file mapped
    mapping: mmap.mmap
    view: np.ndarray  # read-only bytes of the mapping (its address; keeps it mapped)
    data_offset: int
    n_slots: int
    slot_bytes: int
    pages: SlotPages  # which slots' pages are mapped in this process


class PoolFileReader:
    """The pool file a server's hello advertised, mapped read-only when this process may use it.

    Args:
      advert: the hello's ``"local"`` field (untrusted: checked here).
      fingerprint: the layout the server serves (the file must hold a pool of it).
    """

    def __init__(self, advert: Any, fingerprint: bytes) -> None:
        self.advert = advert
        self.fingerprint = fingerprint
        self._lock = threading.Lock()
        self._mapped: _Mapped | None = None
        self._warming: threading.Thread | None = None
        self._closed = False
        self._closing = threading.Event()  # set by close() before it waits for the lock
        self._warned: set[str] = set()  # the reasons logged (each once)
        self.path: str | None = None
        self._file = (-1, -1)  # the server's (st_dev, st_ino) of it
        if (
            isinstance(advert, dict)
            and isinstance(advert.get("path"), str)
            and 0 < len(advert["path"]) <= MAX_PATH_CHARS
            and "\x00" not in advert["path"]
            and os.path.isabs(advert["path"])
            and POOL_FILE.fullmatch(os.path.basename(advert["path"])) is not None
            and advert.get("boot_id") == boot_id()
            and advert.get("uid") == os.geteuid()
            and type(advert.get("dev")) is int
            and type(advert.get("ino")) is int
        ):
            self.path = advert["path"]
            self._file = (advert["dev"], advert["ino"])

    @property
    def usable(self) -> bool:
        """Whether the server runs on this host, as this user (its file may be read)."""
        return self.path is not None

    def warm(self) -> None:
        """Maps the file now and its pages in the background (up to :data:`WARM_MAX_BYTES`),
        so that the first pulls do not map them while they copy. Where the file cannot be read
        it logs why (pulls then go over TCP)."""
        if self.path is None:
            return
        with self._lock:
            if self._closed or self._warming is not None:
                return
            mapped = self._map()
            if mapped is None:
                return
            self._warming = threading.Thread(
                target=self._warm_pages, args=(mapped,), name="tpusync-file-warm", daemon=True
            )
            try:
                self._warming.start()
            except RuntimeError as error:  # no thread to spare: pulls map their own slots
                self._warming = None
                log.warning("tpusync: pool file %s is not mapped ahead: %s", self.path, error)

    def _warm_pages(self, mapped: _Mapped) -> None:
        for slots in mapped.pages.steps(WARM_STEP_BYTES, WARM_MAX_BYTES):
            with self._lock:
                if self._closed or self._mapped is not mapped:
                    return  # closed, or remapped: a new file's pages are mapped when read
                mapped.pages.ensure(slots)

    def land(
        self, layout: PoolLayout, slots: np.ndarray, expected: np.ndarray, scatter: Scatter
    ) -> np.ndarray | None:
        """Copies the blocks in ``slots`` of the file into ``scatter``'s places (block ``i``
        to its runs), each hashed as it is copied; returns whether each block's bytes match
        ``expected`` (its checksum), or None when the file cannot be read now (then nothing
        was written: pull over TCP). Copies :data:`LAND_WINDOW_BYTES` at a time and raises
        PeerUnavailableError when :meth:`close` was called meanwhile (as a closed client's
        TCP pull fails); the places then hold part of the blocks, none reported loaded."""
        if self.path is None or layout.fingerprint != self.fingerprint:
            return None
        with self._lock:
            if self._closed:
                return None
            mapped = self._map()
            if mapped is None:
                return None
            slots = np.asarray(slots, dtype=np.int64)
            if mapped.slot_bytes != layout.slot_bytes or (
                len(slots) and (slots.min() < 0 or slots.max() >= mapped.n_slots)
            ):
                self._warn("the lease named slots outside the pool file, or another slot size")
                return None
            addresses = mapped.view.ctypes.data + mapped.data_offset + slots * mapped.slot_bytes
            window = max(1, LAND_WINDOW_BYTES // layout.payload_bytes)
            digests = []
            for first in range(0, len(slots), window):
                if self._closing.is_set():
                    raise PeerUnavailableError(
                        f"pull from the pool file {self.path}: the client was closed during "
                        "the copy"
                    )
                part = slice(first, first + window)
                blocks = len(slots[part])
                mapped.pages.ensure(slots[part], layout.payload_bytes)
                placed = (
                    scatter
                    if blocks == len(slots)
                    else scatter.select(np.arange(first, first + blocks))
                )
                regions = block_regions(layout, placed, addresses[part])
                digests.append(self._copy(regions, blocks, len(layout.piece_table[0])))
        copied = np.concatenate(digests) if digests else np.empty(0, dtype=np.uint64)
        sums = slot_checksums(copied.reshape(len(slots), -1))
        return sums == np.asarray(expected, dtype=np.uint64)

    def _copy(self, regions: tuple[np.ndarray, ...], blocks: int, pieces: int) -> np.ndarray:
        """``_core.copy_sum64_streams`` over ``regions``, on every copy thread: contiguous runs
        of blocks per thread, the last on this one (the GIL is released while they copy)."""
        sources, targets, lengths, ends = regions
        threads = min(native.copy_threads(), MAX_COPY_THREADS)
        n = min(threads, blocks)
        if n <= 1:
            return _core.copy_sum64_streams(sources, targets, lengths, ends)
        pool = _copy_pool()
        cuts = [b * pieces for b in np.linspace(0, blocks, n + 1).astype(np.int64).tolist()]
        starts = np.concatenate(([0], ends))  # the first region of each stream, and the end

        def part(g0: int, g1: int) -> np.ndarray:
            r0, r1 = int(starts[g0]), int(starts[g1])
            return _core.copy_sum64_streams(
                sources[r0:r1], targets[r0:r1], lengths[r0:r1], ends[g0:g1] - r0
            )

        jobs = [pool.submit(part, a, b) for a, b in itertools.pairwise(cuts[:-1])]
        try:
            last = part(cuts[-2], cuts[-1])
        finally:
            wait(jobs)  # none copies once this returns
        return np.concatenate([*(job.result() for job in jobs), last])

    def _map(self) -> _Mapped | None:
        """The file mapped (again when it changed since: a restarted server's new pool), or
        None (unmapped) when it cannot be read: then the pull goes over TCP."""
        assert self.path is not None
        try:
            fd = open_file(self.path, os.O_RDONLY)
        except (OSError, ValueError, TpuSyncError) as error:
            self._unmap()  # the file is gone: keep none of its memory
            self._warn("cannot open it", error)
            return None
        try:
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != self._file:
                self._unmap()
                self._warn("the file of that name here is not the server's (another mount?)")
                return None
            identity = (info.st_dev, info.st_ino, info.st_size)
            if self._mapped is not None and self._mapped.identity == identity:
                return self._mapped
            self._unmap()
            header = header_of_descriptor(fd)
            size = header.data_offset + header.n_slots * header.slot_bytes
            if header.fingerprint != self.fingerprint or size > info.st_size:
                self._warn("it holds another layout than the server serves")
                return None
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            self._mapped = _Mapped(
                identity,
                mapping,
                np.frombuffer(mapping, dtype=np.uint8),
                header.data_offset,
                header.n_slots,
                header.slot_bytes,
                SlotPages(
                    header.n_slots,
                    header.slot_bytes,
                    header.data_offset,
                    lambda start, length: _populate_read(mapping, start, length),
                ),
            )
            return self._mapped
        except (OSError, ValueError, PoolFormatError) as error:
            self._warn("cannot map it", error)
            return None
        finally:
            os.close(fd)

    def _warn(self, why: str, detail: object = None) -> None:
        """Logs why pulls go over TCP, once per reason (``detail`` varies, the reason not)."""
        if why not in self._warned:
            self._warned.add(why)
            because = why if detail is None else f"{why} ({detail})"
            log.warning("tpusync: pool file %s is read over TCP instead: %s", self.path, because)

    def close(self) -> None:
        """Unmaps the file once a copy in progress stopped (at its next window); later pulls
        go over TCP."""
        self._closing.set()
        with self._lock:
            self._closed = True
            self._unmap()

    def _unmap(self) -> None:
        mapped, self._mapped = self._mapped, None
        if mapped is not None:
            mapped.view = np.empty(0, dtype=np.uint8)  # the mapping's only export
            mapped.mapping.close()


def _populate_read(mapping: mmap.mmap, start: int, length: int) -> None:
    """Maps ``length`` bytes of ``mapping`` from ``start`` for reading, in one call."""
    aligned = start - start % mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):  # an older kernel: the copy faults them in
        mapping.madvise(_MADV_POPULATE_READ, aligned, length + start - aligned)


def block_regions(
    layout: PoolLayout, scatter: Scatter, addresses: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The copy of blocks at ``addresses`` (one payload each) to ``scatter``'s runs, as
    ``_core.copy_sum64_streams`` takes it: regions (source, target, length; target 0 where a
    run lands nowhere: only hashed), one stream of regions per piece of each block in order,
    so that the streams' digests are the pieces' checksums. The bytes between pieces are not
    copied (no checksum covers them)."""
    size = layout.payload_bytes
    piece_offsets, piece_lengths = (np.asarray(a, dtype=np.int64) for a in layout.piece_table)
    n = len(addresses)
    base = np.arange(n, dtype=np.int64)[:, None] * size
    piece_starts = (base + piece_offsets[None, :]).reshape(-1)
    piece_ends = (base + (piece_offsets + piece_lengths)[None, :]).reshape(-1)
    counts = np.diff(scatter.first)
    run_starts = np.repeat(np.arange(n, dtype=np.int64), counts) * size + scatter.offsets
    cuts = np.unique(np.concatenate([piece_starts, piece_ends, run_starts]))
    starts, stops = cuts[:-1], cuts[1:]
    piece = np.searchsorted(piece_starts, starts, side="right") - 1
    inside = (piece >= 0) & (starts < piece_ends[np.maximum(piece, 0)])
    starts, stops, piece = starts[inside], stops[inside], piece[inside]
    run = np.searchsorted(run_starts, starts, side="right") - 1
    block = starts // size
    offset = starts - block * size
    sources = np.asarray(addresses, dtype=np.int64)[block] + offset
    run_targets = scatter.targets[run].astype(np.int64)
    targets = np.where(run_targets == 0, 0, run_targets + offset - scatter.offsets[run])
    ends = np.searchsorted(piece, np.arange(n * len(piece_offsets)), side="right")
    return (
        sources.astype(np.uint64),
        targets.astype(np.uint64),
        (stops - starts).astype(np.uint64),
        ends.astype(np.int64),
    )


def lease_slots(lease: Any, n: int) -> np.ndarray | None:
    """The slots an acquire answer names (None when it names none or they are malformed:
    then the pull goes over TCP)."""
    slots = lease.get("slots") if isinstance(lease, dict) else None
    if (
        not isinstance(slots, list)
        or len(slots) != n
        or not all(type(s) is int and -1 <= s < 2**62 for s in slots)
    ):
        return None
    return np.array(slots, dtype=np.int64)


def whole_slots(addresses: np.ndarray) -> Scatter:
    """Blocks landing whole at ``addresses`` (a pool's slots), as a scatter."""
    n = len(addresses)
    return Scatter(
        np.arange(n + 1, dtype=np.int64), np.zeros(n, dtype=np.int64), addresses.astype(np.uint64)
    )
