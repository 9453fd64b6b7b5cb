# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The physical limits benchmark figures are divided by, timed in C with the GIL released:
a copy of one contiguous region on all cores, and TCP over loopback with one sender and one
receiver thread per stream (csrc/limits.c)."""

from libc.stdlib cimport free, malloc
from libc.string cimport strerror

from tpusync.errors import InvalidArgumentError

cdef extern from "tpusync/limits.h" nogil:
    int tps_limit_copy(char *dst, const char *src, size_t n, int threads, int method,
                       int repeats, double *seconds)
    int tps_limit_have_streaming()
    int tps_limit_tcp(int streams, size_t nbytes, size_t warm_bytes, size_t chunk, int sndbuf,
                      size_t lowat, int repeats, int sender_cpu, int receiver_cpu,
                      double *seconds)

COPY_METHODS = {"memcpy": 0, "stream": 1, "stream_pages": 2, "stream_four": 3}


def have_streaming() -> bool:
    """Whether the non-temporal copy methods exist on this CPU."""
    return bool(tps_limit_have_streaming())


def copy_seconds(dst, src, int threads, str method, int repeats) -> list:
    """Copies ``src`` into ``dst`` (equal-sized C-contiguous uint8 arrays) ``repeats`` times on
    ``threads`` threads started once, each its own slice; the seconds of each repeat."""
    cdef unsigned char[::1] d = dst
    cdef const unsigned char[::1] s = src
    if d.shape[0] != s.shape[0]:
        raise InvalidArgumentError(
            f"dst, src: expected equal sizes, got {d.shape[0]} and {s.shape[0]} bytes"
        )
    if method not in COPY_METHODS:
        raise InvalidArgumentError(f"method: expected one of {sorted(COPY_METHODS)}, got {method!r}")
    if threads < 1 or repeats < 1:
        raise InvalidArgumentError(
            f"threads, repeats: expected positive ints, got {threads} and {repeats}"
        )
    cdef int m = COPY_METHODS[method]
    cdef size_t n = d.shape[0]
    cdef double *seconds = <double *>malloc(repeats * sizeof(double))
    cdef int err
    if seconds == NULL:
        raise MemoryError()
    try:
        with nogil:
            err = tps_limit_copy(<char *>&d[0] if n else NULL, <const char *>&s[0] if n else NULL,
                                 n, threads, m, repeats, seconds)
        if err:
            raise OSError(err, strerror(err).decode())
        return [seconds[i] for i in range(repeats)]
    finally:
        free(seconds)


def tcp_seconds(int streams, size_t nbytes, size_t warm_bytes, size_t chunk, int sndbuf,
                int repeats, size_t lowat=0, int sender_cpu=-1, int receiver_cpu=-1) -> list:
    """Moves ``nbytes`` per stream over ``streams`` loopback connections at once, ``repeats``
    times after ``warm_bytes`` untimed; the seconds of each repeat (see csrc/limits.c).
    ``lowat``: the receiver's SO_RCVLOWAT step (0: the kernel's default). ``sender_cpu``,
    ``receiver_cpu``: the CPU each sending / receiving thread is pinned to (-1: not pinned)."""
    if streams < 1 or repeats < 1 or chunk < 1 or nbytes < 1:
        raise InvalidArgumentError(
            "streams, repeats, chunk, nbytes: expected positive ints, got "
            f"{streams}, {repeats}, {chunk} and {nbytes}"
        )
    if sender_cpu < -1 or receiver_cpu < -1:
        raise InvalidArgumentError(
            "sender_cpu, receiver_cpu: expected a CPU number or -1 (not pinned), got "
            f"{sender_cpu} and {receiver_cpu}"
        )
    cdef double *seconds = <double *>malloc(repeats * sizeof(double))
    cdef int err
    if seconds == NULL:
        raise MemoryError()
    try:
        with nogil:
            err = tps_limit_tcp(streams, nbytes, warm_bytes, chunk, sndbuf, lowat, repeats,
                                sender_cpu, receiver_cpu, seconds)
        if err:
            raise OSError(err, strerror(err).decode())
        return [seconds[i] for i in range(repeats)]
    finally:
        free(seconds)
