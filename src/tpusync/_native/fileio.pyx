# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Block file I/O in C with the GIL released for the whole batch (csrc/file_runs.c): many runs
of ``preadv``/``pwritev`` on a few threads, so that no Python thread holding the GIL (an
engine's step loop) delays each I/O's return."""

from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc

import numpy as np

from tpusync.errors import InvalidArgumentError

cdef extern from "sys/uio.h" nogil:
    cdef struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "tpusync/file_runs.h" nogil:
    ctypedef struct tps_file_run:
        int fd
        int32_t first_iov
        int32_t iov_count
        int64_t offset
    enum: TPS_FILE_RUN_MAX_IOVS
    int tps_file_runs(const tps_file_run *runs, int n_runs, const iovec *iovs, int write,
                      int threads, int stop_on_error, int *errs)

MAX_IOVS_PER_RUN = TPS_FILE_RUN_MAX_IOVS


def file_runs(fds, offsets, first_iov, iov_counts, addresses, lengths, bint write,
              int threads, bint stop_on_error):
    """Reads (``write`` False) or writes every run ``r``: the ``iov_counts[r]`` buffers from
    ``first_iov[r]`` (``addresses``/``lengths``, memory the caller keeps alive) as one range of
    file ``fds[r]`` from ``offsets[r]``, on ``threads`` threads. Returns each run's errno (0: done;
    ``errno.EIO``: the file ended or a write made no progress; ``errno.ECANCELED``: skipped
    after another run failed, with ``stop_on_error``) as an int32 array."""
    cdef const int32_t[::1] fd_v = np.ascontiguousarray(fds, dtype=np.int32)
    cdef const int64_t[::1] off_v = np.ascontiguousarray(offsets, dtype=np.int64)
    cdef const int32_t[::1] first_v = np.ascontiguousarray(first_iov, dtype=np.int32)
    cdef const int32_t[::1] count_v = np.ascontiguousarray(iov_counts, dtype=np.int32)
    cdef const uint64_t[::1] addr_v = np.ascontiguousarray(addresses, dtype=np.uint64)
    cdef const uint64_t[::1] len_v = np.ascontiguousarray(lengths, dtype=np.uint64)
    cdef Py_ssize_t n = fd_v.shape[0], m = addr_v.shape[0], r, i
    if off_v.shape[0] != n or first_v.shape[0] != n or count_v.shape[0] != n:
        raise InvalidArgumentError("fds, offsets, first_iov, iov_counts: expected equal lengths")
    if len_v.shape[0] != m:
        raise InvalidArgumentError("addresses, lengths: expected equal lengths")
    for r in range(n):
        if (count_v[r] < 1 or count_v[r] > TPS_FILE_RUN_MAX_IOVS or first_v[r] < 0
                or <Py_ssize_t>first_v[r] + <Py_ssize_t>count_v[r] > m or off_v[r] < 0
                or fd_v[r] < 0):
            raise InvalidArgumentError(
                f"runs: run {r} (fd {fd_v[r]}, offset {off_v[r]}, buffers {first_v[r]} + "
                f"{count_v[r]}) is outside the {m} buffers given"
            )
    for i in range(m):
        if len_v[i] == 0 or len_v[i] > (1 << 40):
            raise InvalidArgumentError(
                f"lengths: buffer {i} has {len_v[i]} bytes; expected 1 to 2**40"
            )
    if threads < 1:
        raise InvalidArgumentError(f"threads: expected a positive int, got {threads}")
    errs = np.zeros(n, dtype=np.int32)
    cdef int32_t[::1] err_v = errs
    if n == 0:
        return errs
    cdef tps_file_run *runs = <tps_file_run *>malloc(n * sizeof(tps_file_run))
    cdef iovec *iovs = <iovec *>malloc(max(m, 1) * sizeof(iovec))
    try:
        if runs == NULL or iovs == NULL:
            raise MemoryError()
        for r in range(n):
            runs[r].fd = fd_v[r]
            runs[r].first_iov = first_v[r]
            runs[r].iov_count = count_v[r]
            runs[r].offset = off_v[r]
        for i in range(m):
            iovs[i].iov_base = <void *><size_t>addr_v[i]
            iovs[i].iov_len = <size_t>len_v[i]
        with nogil:
            tps_file_runs(runs, <int>n, iovs, write, threads, stop_on_error, <int *>&err_v[0])
        return errs
    finally:
        free(runs)
        free(iovs)
