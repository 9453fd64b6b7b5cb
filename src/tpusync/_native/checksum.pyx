# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Checksums of tpusync's blocks and keys, GIL released: CRC-32C, the piece checksum sum64,
XXH64 and keyed BLAKE2b (include/tpusync/checksum.h, blake2b.h).

This module owns the process's choice of checksum code path (:func:`_force_portable_checksum`):
the other extensions that link the checksum code (copy, net) read it through
:func:`shared_path_flag`."""

from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.stdint cimport int64_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy

cimport numpy as cnp

from tpusync._native._blake2b cimport (
    tps_blake2b, tps_blake2b_chain, tps_blake2b_final, tps_blake2b_init, tps_blake2b_update,
)
from tpusync._native._checksum cimport (
    tps_checksum_force_portable, tps_checksum_kernel, tps_checksum_path_flag, tps_crc32c,
    tps_crc32c_shift, tps_sum64, tps_sum64_copy_streaming_next, tps_sum64_digest, tps_sum64_init, tps_sum64_state,
    tps_sum64_update, tps_xxh64,
)


cdef extern from "immintrin.h" nogil:
    void _mm_sfence()

import numpy as np

cnp.import_array()


cdef int *shared_path_flag() noexcept nogil:
    """The one checksum code path flag of the process (this module's)."""
    return tps_checksum_path_flag()


def sum64(data):
    """tpusync's piece checksum (format 1) of a contiguous buffer: three CRC-32C lanes mixed
    into 64 bits (see include/tpusync/checksum.h). GIL released."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const void *p = &view[0] if n else NULL
    cdef uint64_t digest
    with nogil:
        digest = tps_sum64(p, n)
    return digest


def crc32c(data, uint32_t crc=0):
    """CRC-32C of a contiguous buffer, continuing from ``crc``."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const void *p = &view[0] if n else NULL
    with nogil:
        crc = tps_crc32c(crc, p, n)
    return crc


def _crc32c_shift(uint32_t crc, uint64_t nbytes):
    """Tests only: a raw CRC-32C value (no inversions) continued over ``nbytes`` zero bytes,
    as the fused copy joins the lanes of pieces computed apart."""
    return tps_crc32c_shift(crc, nbytes)


def _force_portable_checksum(int on):
    """Tests only: 1 (True) uses the table CRC-32C instead of the CPU's instructions, 2 the CRC
    instruction without the carry-less multiplication paths, 3 the 128-bit carry-less
    multiplication (PCLMULQDQ) even where AVX-512 is there, 0 (False) the fastest."""
    tps_checksum_force_portable(on)


def _checksum_kernel():
    """Tests only: the kernel sum64 and its fused copy run whole 192-byte blocks through under
    the current :func:`_force_portable_checksum` choice on this CPU ("clmul512", "clmul128"
    from 16 blocks on, "crc32" or "table"): a path the CPU lacks falls back to another, and
    a test of it would test that one. Dispatch reads the same choice."""
    return tps_checksum_kernel().decode()


def xxh64(data, uint64_t seed=0):
    """XXH64 of any contiguous buffer (bytes, memoryview, numpy array), GIL released."""
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const void *p = &view[0] if n else NULL
    cdef uint64_t digest
    with nogil:
        digest = tps_xxh64(p, n, seed)
    return digest


def xxh64_rows(const uint64_t[:, ::1] rows not None, uint64_t seed=0):
    """XXH64 of each row's bytes (the row's uint64 values in memory order), as a uint64 array:
    one call for many short rows, GIL released."""
    cdef Py_ssize_t n = rows.shape[0], i
    cdef size_t row_bytes = <size_t> rows.shape[1] * 8
    cdef cnp.ndarray out = np.empty(n, dtype=np.uint64)
    cdef uint64_t *digests = <uint64_t *> cnp.PyArray_DATA(out)
    cdef const uint64_t *base = &rows[0, 0] if n and row_bytes else NULL
    with nogil:
        for i in range(n):
            digests[i] = tps_xxh64(base + i * rows.shape[1] if base != NULL else NULL,
                                   row_bytes, seed)
    return out


def xxh64_gathered(const uint64_t[::1] digests not None, const int64_t[::1] rows not None,
                   Py_ssize_t n_blocks, uint64_t seed=0):
    """For each block b of a hashed job's digests (laid out row-major: ``digests[r * n_blocks
    + b]``), XXH64 of the little-endian bytes of ``digests[rows[k] * n_blocks + b]`` for k in
    order: :func:`xxh64_rows` of the gathered, transposed rows, in one call (a block's
    checksum from its pieces' checksums, without numpy's gather and transpose)."""
    cdef Py_ssize_t n_rows = rows.shape[0], b, k, j
    if n_blocks < 0 or (n_blocks and digests.shape[0] % n_blocks):
        raise ValueError("digests do not hold whole rows of n_blocks")
    if n_blocks == 0:
        return np.zeros(0, dtype=np.uint64)
    cdef Py_ssize_t total_rows = digests.shape[0] // n_blocks
    for k in range(n_rows):
        if not 0 <= rows[k] < total_rows:
            raise ValueError(f"rows[{k}] = {rows[k]} is not a row of digests")
    cdef cnp.ndarray out = np.empty(n_blocks, dtype=np.uint64)
    cdef uint64_t *sums = <uint64_t *> cnp.PyArray_DATA(out)
    cdef unsigned char *row = <unsigned char *> PyMem_Malloc(max(n_rows, 1) * 8)
    cdef uint64_t value
    if row == NULL:
        raise MemoryError()
    with nogil:
        for b in range(n_blocks):
            for k in range(n_rows):
                value = digests[rows[k] * n_blocks + b]
                for j in range(8):
                    row[k * 8 + j] = <unsigned char> (value >> (8 * j))
            sums[b] = tps_xxh64(row, <size_t> n_rows * 8, seed)
    PyMem_Free(row)
    return out


def sum64_regions(const uint64_t[::1] starts not None, const uint64_t[::1] lengths not None):
    """The piece checksum (``sum64``) of each memory region ``starts[i], lengths[i]``, computed
    on the calling thread with the GIL released: for short jobs (one block's pieces) where
    handing them to the engine's threads costs more than it saves, and so that several callers
    hash at once (the engine runs one job at a time). The caller keeps the memory alive."""
    cdef Py_ssize_t n = starts.shape[0], i
    if lengths.shape[0] != n:
        raise ValueError("starts and lengths differ in length")
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t[::1] digests = out
    with nogil:
        for i in range(n):
            digests[i] = tps_sum64(<const void *><uintptr_t>starts[i], <size_t>lengths[i])
    return out


cdef enum:
    # pieces of a copy hashed while still in cache: small enough for L2 on every machine
    _CACHED_PIECE = 65536


cdef void _copy_hash_region(tps_sum64_state *state, char *dst, const char *src, size_t n,
                            const void *next) noexcept nogil:
    """Copies ``n`` bytes and feeds them to ``state``: in one pass with non-temporal stores
    where the fast path applies (no partial group pending: it is fed first; an 8-byte aligned
    destination), else in cached pieces hashed right after their copy."""
    cdef size_t take, step
    if state.n_pending:
        take = 24 - state.n_pending
        if take > n:
            take = n
        memcpy(dst, src, take)
        tps_sum64_update(state, dst, take)
        dst += take
        src += take
        n -= take
    if n == 0 or tps_sum64_copy_streaming_next(state, dst, src, n, next):
        return
    while n:
        step = n if n < _CACHED_PIECE else _CACHED_PIECE
        memcpy(dst, src, step)
        tps_sum64_update(state, dst, step)
        dst += step
        src += step
        n -= step


def copy_sum64_streams(const uint64_t[::1] sources not None,
                       const uint64_t[::1] targets not None,
                       const uint64_t[::1] lengths not None,
                       const int64_t[::1] ends not None):
    """Copies each region ``sources[i]`` -> ``targets[i]`` (``lengths[i]`` bytes; a target of 0
    only hashes the source) and returns, per stream of regions (stream ``g`` is the regions
    ``ends[g-1]:ends[g]``, from 0 for the first, taken in order as one run),
    the ``sum64`` of the bytes copied (the source's where nothing is written), in one pass:
    each region is hashed as it is copied (registers, or the cache right after). GIL released,
    on the calling thread; the regions of one call must not overlap; the caller keeps the
    memory alive."""
    cdef Py_ssize_t n = sources.shape[0], groups = ends.shape[0], g, i, first = 0
    if targets.shape[0] != n or lengths.shape[0] != n:
        raise ValueError("sources, targets and lengths differ in length")
    for g in range(groups):
        if ends[g] < first or ends[g] > n:
            raise ValueError("ends must rise from 0 to len(sources)")
        first = ends[g]
    out = np.empty(groups, dtype=np.uint64)
    cdef uint64_t[::1] digests = out
    cdef tps_sum64_state state
    cdef const char *src
    cdef const void *after
    first = 0
    with nogil:
        for g in range(groups):
            tps_sum64_init(&state)
            for i in range(first, ends[g]):
                src = <const char *><uintptr_t>sources[i]
                if targets[i] == 0:
                    tps_sum64_update(&state, src, <size_t>lengths[i])
                    continue
                after = <const void *><uintptr_t>sources[i + 1] if i + 1 < n else NULL
                _copy_hash_region(&state, <char *><uintptr_t>targets[i], src,
                                  <size_t>lengths[i], after)
            digests[g] = tps_sum64_digest(&state)
            first = ends[g]
        _mm_sfence()  # the streaming stores are seen by whoever reads the targets next
    return out

cdef tps_blake2b _blake2b_start(size_t digest_size, bytes key, bytes person) except *:
    cdef tps_blake2b state
    if tps_blake2b_init(&state, digest_size, <const char *> key, len(key),
                        <const char *> person, len(person)) != 0:
        raise ValueError("BLAKE2b takes a digest of 1 to 64 bytes, a key of at most 64 and a "
                         "personalisation of at most 16")
    return state


def blake2b(const unsigned char[::1] data not None, bytes key=b"", bytes person=b"",
            size_t digest_size=64):
    """BLAKE2b of ``data`` (as ``hashlib.blake2b(data, key=..., person=..., digest_size=...)``
    answers it; no salt). For the tests of :func:`blake2b_chain`."""
    cdef tps_blake2b state = _blake2b_start(digest_size, key, person)
    cdef bytearray out = bytearray(digest_size)
    cdef unsigned char *dst = out
    with nogil:
        if data.shape[0]:
            tps_blake2b_update(&state, &data[0], <size_t> data.shape[0])
        tps_blake2b_final(&state, dst)
    return bytes(out)


def blake2b_chain(bytes start not None, const unsigned char[::1] data not None, size_t step,
                  bytes key=b"", bytes person=b"", bytes tag=b""):
    """The chain of keyed BLAKE2b values over ``data`` cut into pieces of ``step`` bytes:
    value i = BLAKE2b(value i-1 + piece i), value -1 = ``start`` (its length is the digest
    size), as the ``blake2b-chain-v1`` key scheme computes block keys (tpusync/_src/kv/keys.py).
    Returns ``tag + value`` for each whole piece, as a list of bytes. GIL released while
    hashing."""
    if step == 0:
        raise ValueError("step must be > 0")
    cdef tps_blake2b prefix = _blake2b_start(len(start), key, person)
    cdef size_t n = <size_t> data.shape[0] // step
    cdef size_t width = len(start), tag_bytes = len(tag), i
    cdef bytearray values = bytearray(n * width)
    cdef unsigned char *dst = values
    cdef const unsigned char *first = start
    cdef const unsigned char *src = &data[0] if data.shape[0] else NULL
    with nogil:
        if n:
            tps_blake2b_chain(&prefix, first, src, step, n, dst)
    cdef bytearray joined = bytearray(tag_bytes + width)
    cdef unsigned char *at = joined
    if tag_bytes:
        memcpy(at, <const char *> tag, tag_bytes)
    out = []
    for i in range(n):
        memcpy(at + tag_bytes, dst + i * width, width)
        out.append(PyBytes_FromStringAndSize(<const char *> at, tag_bytes + width))
    return out
