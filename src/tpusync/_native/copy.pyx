# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Block gather/scatter: segment tables from block lists, and the copy engine, a pool of native
threads that copies (and checksums, in the same pass) lists of byte segments with the GIL
released (include/tpusync/copy_engine.h)."""

from libc.errno cimport errno
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport strerror

cimport numpy as cnp

from tpusync._native._checksum cimport tps_checksum_share_path_flag
from tpusync._native._copy_engine cimport (
    tps_engine, tps_engine_copy, tps_engine_copy_hashed, tps_engine_create, tps_engine_destroy,
    tps_engine_hash, tps_engine_threads, tps_gomp_parallel_fn, tps_omp_query_fn,
    tps_openmp_here, tps_openmp_install, tps_openmp_installed, tps_segment,
)
from tpusync._native.checksum cimport shared_path_flag

import numpy as np

cnp.import_array()

# The fused copy-and-checksum runs this module's copy of the checksum code: on the code path
# the checksum module chose.
tps_checksum_share_path_flag(shared_path_flag())


def block_segments(
    const int64_t[::1] src_outer, int64_t src_block_stride,
    const int64_t[::1] dst_outer, int64_t dst_block_stride,
    const int64_t[::1] src_blocks, const int64_t[::1] dst_blocks,
    uint64_t nbytes, bint merge=True,
):
    """Rows (src, dst, nbytes) moving ``src_blocks[i]`` to ``dst_blocks[i]`` for every outer
    index o: addresses ``*_outer[o] + *_blocks[i] * *_block_stride``, in (o, i) order. With
    ``merge``, a row continuing the previous one on both sides extends it."""
    cdef Py_ssize_t n_outer = src_outer.shape[0], n_blocks = src_blocks.shape[0]
    if dst_outer.shape[0] != n_outer or dst_blocks.shape[0] != n_blocks:
        raise ValueError("source and destination lists differ in length")
    cdef cnp.ndarray table = np.empty((n_outer * n_blocks, 3), dtype=np.uint64)
    cdef uint64_t[:, ::1] out = table
    cdef Py_ssize_t o, i, rows = 0
    cdef uint64_t s, d
    with nogil:
        for o in range(n_outer):
            for i in range(n_blocks):
                s = <uint64_t> (src_outer[o] + src_blocks[i] * src_block_stride)
                d = <uint64_t> (dst_outer[o] + dst_blocks[i] * dst_block_stride)
                if (merge and rows > 0 and out[rows - 1, 0] + out[rows - 1, 2] == s
                        and out[rows - 1, 1] + out[rows - 1, 2] == d):
                    out[rows - 1, 2] += nbytes
                else:
                    out[rows, 0] = s
                    out[rows, 1] = d
                    out[rows, 2] = nbytes
                    rows += 1
    return table[:rows]


cdef class BlockRows:
    """A plan's per-row geometry, checked once; :meth:`rows` turns one call's buffer bases
    and block lists into its segment table. Row r of pair ``p = pair_of_row[r]`` (a pair of
    buffers) moves ``nbytes[r]`` bytes for each block i, from ``pair_bases[p, 0] + src_rel[r]
    + src_blocks[i] * src_step[r]`` to ``pair_bases[p, 1] + dst_rel[r] + dst_blocks[i] *
    dst_step[r]``. Kept by the plan: taking seven arrays' buffers again on every call is costly
    right after a model step (docs/decisions/0004)."""

    cdef const int64_t[::1] _pair_of_row
    cdef const int64_t[::1] _src_rel
    cdef const int64_t[::1] _src_step
    cdef const int64_t[::1] _dst_rel
    cdef const int64_t[::1] _dst_step
    cdef const uint64_t[::1] _nbytes
    cdef readonly Py_ssize_t n_rows, n_pairs

    def __init__(self, const int64_t[::1] pair_of_row not None,
                 const int64_t[::1] src_rel not None, const int64_t[::1] src_step not None,
                 const int64_t[::1] dst_rel not None, const int64_t[::1] dst_step not None,
                 const uint64_t[::1] nbytes not None, Py_ssize_t n_pairs):
        cdef Py_ssize_t r, n = src_rel.shape[0]
        if (src_step.shape[0] != n or dst_rel.shape[0] != n or pair_of_row.shape[0] != n
                or dst_step.shape[0] != n or nbytes.shape[0] != n):
            raise ValueError("the per-row arrays differ in length")
        for r in range(n):
            if not 0 <= pair_of_row[r] < n_pairs:
                raise ValueError(f"pair_of_row[{r}] = {pair_of_row[r]} is not a pair")
        self._pair_of_row, self._src_rel, self._src_step = pair_of_row, src_rel, src_step
        self._dst_rel, self._dst_step, self._nbytes = dst_rel, dst_step, nbytes
        self.n_rows, self.n_pairs = n, n_pairs

    def rows(self, const int64_t[:, ::1] pair_bases not None,
             const int64_t[::1] src_blocks not None, const int64_t[::1] dst_blocks not None):
        """The segment table (uint64, rows (src, dst, nbytes)) for every row r and block i,
        in (r, i) order: one pass with the GIL released."""
        cdef Py_ssize_t n_blocks = src_blocks.shape[0], r, i, at, p
        if pair_bases.shape[0] != self.n_pairs or pair_bases.shape[1] != 2:
            raise ValueError(f"pair_bases must have shape ({self.n_pairs}, 2)")
        if dst_blocks.shape[0] != n_blocks:
            raise ValueError("source and destination block lists differ in length")
        cdef cnp.ndarray table = np.empty((self.n_rows * n_blocks, 3), dtype=np.uint64)
        cdef uint64_t *out = <uint64_t *> cnp.PyArray_DATA(table)
        cdef int64_t src, dst, src_step, dst_step
        cdef uint64_t nbytes
        with nogil:
            at = 0
            for r in range(self.n_rows):
                p = self._pair_of_row[r]
                src = pair_bases[p, 0] + self._src_rel[r]
                dst = pair_bases[p, 1] + self._dst_rel[r]
                src_step, dst_step, nbytes = self._src_step[r], self._dst_step[r], self._nbytes[r]
                for i in range(n_blocks):
                    out[at] = <uint64_t> (src + src_blocks[i] * src_step)
                    out[at + 1] = <uint64_t> (dst + dst_blocks[i] * dst_step)
                    out[at + 2] = nbytes
                    at += 3
        return table


def table_bounds(const uint64_t[:, ::1] table):
    """(lowest source byte, end of the highest source range, lowest destination byte, end of
    the highest destination range) of a non-empty segment table, in one pass, GIL released."""
    cdef Py_ssize_t n = table.shape[0], i
    if n == 0 or table.shape[1] != 3:
        raise ValueError("expected a non-empty table of shape (n, 3)")
    cdef uint64_t src_lo = table[0, 0], src_hi = 0, dst_lo = table[0, 1], dst_hi = 0, end
    with nogil:
        for i in range(n):
            if table[i, 0] < src_lo:
                src_lo = table[i, 0]
            end = table[i, 0] + table[i, 2]
            if end > src_hi:
                src_hi = end
            if table[i, 1] < dst_lo:
                dst_lo = table[i, 1]
            end = table[i, 1] + table[i, 2]
            if end > dst_hi:
                dst_hi = end
    return src_lo, src_hi, dst_lo, dst_hi


def openmp_install(uint64_t parallel, uint64_t thread_num, uint64_t num_threads):
    """Gives the copy engine an OpenMP runtime: the addresses of its ``GOMP_parallel``,
    ``omp_get_thread_num`` and ``omp_get_num_threads`` (GNU's ABI), as a loaded library
    exports them (include/tpusync/copy_engine.h). They must stay loaded for the process's life."""
    if not (parallel and thread_num and num_threads):
        raise ValueError("openmp_install needs the three entry points' addresses")
    tps_openmp_install(<tps_gomp_parallel_fn> <void *> parallel,
                       <tps_omp_query_fn> <void *> thread_num,
                       <tps_omp_query_fn> <void *> num_threads)


def openmp_installed():
    """Whether :func:`openmp_install` gave the engine a runtime."""
    return bool(tps_openmp_installed())


def openmp_here(bint on):
    """Makes this thread's parallel copy jobs run on its OpenMP team (or, ``False``, on the
    engine's threads again); returns the previous setting of this thread."""
    return bool(tps_openmp_here(on))


cdef cnp.ndarray segment_table(cnp.ndarray segments):
    """Checks a segment table (uint64, shape (n, 3)) and returns it C-contiguous."""
    if segments.dtype != np.uint64 or segments.ndim != 2 or segments.shape[1] != 3:
        raise ValueError("segments must be a uint64 array of shape (n, 3)")
    return np.ascontiguousarray(segments)


cdef class CopyEngine:
    """A pool of native threads that copies lists of byte segments with the GIL released.

    Segments are rows ``(src_address, dst_address, nbytes)`` of a C-contiguous ``uint64`` array
    of shape ``(n, 3)``. The caller keeps every address valid until :meth:`copy` returns.
    """

    cdef tps_engine *_engine
    cdef readonly int threads
    cdef public uint64_t min_parallel_bytes

    def __cinit__(self, int threads, uint64_t min_parallel_bytes=1 << 20):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._engine = tps_engine_create(threads)
        if self._engine == NULL:
            raise OSError(errno, f"tpusync: cannot start {threads} copy threads: "
                                 f"{strerror(errno).decode()}")
        self.threads = tps_engine_threads(self._engine)
        self.min_parallel_bytes = min_parallel_bytes

    def __dealloc__(self):
        if self._engine != NULL:
            tps_engine_destroy(self._engine)
            self._engine = NULL

    def copy(self, cnp.ndarray segments not None):
        """Copies every segment; returns the number of bytes copied."""
        segments = segment_table(segments)
        cdef const tps_segment *segs = <const tps_segment *> cnp.PyArray_DATA(segments)
        cdef size_t n = <size_t> segments.shape[0]
        cdef uint64_t copied
        with nogil:
            copied = tps_engine_copy(self._engine, segs, n, self.min_parallel_bytes)
        return copied

    def copy_hashed(self, cnp.ndarray segments not None):
        """Copies every segment and returns a uint64 array: the piece checksum
        (:func:`sum64`) of each segment's bytes, computed in the same pass as the copy."""
        return self._checksums(segments, copy=True)

    def hash(self, cnp.ndarray segments not None):
        """The piece checksum (:func:`sum64`) of each segment's source bytes (the destination
        column is ignored)."""
        return self._checksums(segments, copy=False)

    cdef cnp.ndarray _checksums(self, cnp.ndarray segments, bint copy):
        segments = segment_table(segments)
        cdef cnp.ndarray digests = np.empty(segments.shape[0], dtype=np.uint64)
        cdef const tps_segment *segs = <const tps_segment *> cnp.PyArray_DATA(segments)
        cdef uint64_t *out = <uint64_t *> cnp.PyArray_DATA(digests)
        cdef size_t n = <size_t> segments.shape[0]
        with nogil:
            if copy:
                tps_engine_copy_hashed(self._engine, segs, n, out, self.min_parallel_bytes)
            else:
                tps_engine_hash(self._engine, segs, n, out, self.min_parallel_bytes)
        return digests
