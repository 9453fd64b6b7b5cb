# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""tpusync's native core: GIL-free byte movement and page-aligned memory. No policy lives here."""

from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo
from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.errno cimport errno
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp, memcpy, memset, strerror
from libc.stdlib cimport qsort
from posix.mman cimport (
    MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, MAP_SHARED, PROT_NONE,
    PROT_READ, PROT_WRITE, mmap, munmap,
)

cimport numpy as cnp

from tpusync._copy_engine cimport (
    tps_engine, tps_engine_copy, tps_engine_copy_hashed, tps_engine_create, tps_engine_destroy,
    tps_engine_hash, tps_engine_threads, tps_segment, tps_xxh64, tps_crc32c, tps_crc32c_shift,
    tps_sum64, tps_sum64_state, tps_sum64_init, tps_sum64_update, tps_sum64_digest,
    tps_checksum_force_portable,
)

import os

import numpy as np

cnp.import_array()

# Page size of this host; every Mapping starts on a page boundary.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)
    int MADV_HUGEPAGE

# Linux >= 5.14: map a range's pages in one call (faulting them one by one cost ~6 us per page
# in a VM here). Older kernels answer EINVAL and the range is touched page by page instead.
# For pages that exist already (a re-attached /dev/shm pool) mapping them for reading is enough
# and cheaper: 512 MiB in ~25 ms read against ~65 ms write here.
cdef int MADV_POPULATE_READ_ = 22
cdef int MADV_POPULATE_WRITE_ = 23
# Linux >= 6.1: back a range with huge pages now, copying its small pages (EINVAL before).
cdef int MADV_COLLAPSE_ = 25
cdef size_t HUGE_PAGE = 2 << 20
cdef size_t HASH_STEP = 64 << 10  # bytes recv_exact gathers before hashing them


def collapse_huge_pages(uintptr_t address, size_t length):
    """Backs the whole 2 MiB pages inside [address, address + length) with transparent huge
    pages now: advises MADV_HUGEPAGE, then MADV_COLLAPSE (which keeps the contents; writers
    meanwhile wait in a page fault). Returns the bytes collapsed, 0 when the range holds no
    whole huge page, or ``-errno`` when the kernel refuses (an older kernel, THP disabled, a
    range not mapped). Only performance changes: never the bytes. GIL released."""
    cdef uintptr_t first = (address + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    cdef uintptr_t end = (address + length) // HUGE_PAGE * HUGE_PAGE
    cdef int failed = 0
    if end <= first:
        return 0
    with nogil:
        madvise(<void *> first, end - first, MADV_HUGEPAGE)  # so the kernel keeps them huge
        if madvise(<void *> first, end - first, MADV_COLLAPSE_) != 0:
            failed = errno
    return -failed if failed else <Py_ssize_t> (end - first)


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
    dst_step[r]``. Kept by the plan, since taking seven arrays' buffers again on every call
    cost ~15 us right after a model step."""

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


cdef cnp.ndarray _segment_table(cnp.ndarray segments):
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
        segments = _segment_table(segments)
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
        segments = _segment_table(segments)
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
    instruction without the AVX-512 carry-less multiplication paths, 0 (False) the fastest."""
    tps_checksum_force_portable(on)


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


def pin_slots(dict index not None, list keys not None, int64_t[::1] pins not None,
              const uint64_t[:] checksums not None):
    """A slot pool's pin in one pass: each key's slot in ``index`` (-1 where absent) and its
    recorded checksum (0 where absent), one pin added to each present slot. Returns (slots,
    checksums, all present). Every slot is checked before any pin is taken, so an error
    changes nothing. Call with the pool's lock held."""
    cdef Py_ssize_t n = len(keys), i, capacity = min(pins.shape[0], checksums.shape[0])
    cdef cnp.ndarray slots = np.empty(n, dtype=np.int64)
    cdef cnp.ndarray sums = np.zeros(n, dtype=np.uint64)
    cdef int64_t *s = <int64_t *> cnp.PyArray_DATA(slots)
    cdef uint64_t *c = <uint64_t *> cnp.PyArray_DATA(sums)
    cdef bint all_present = True
    cdef int64_t slot
    for i in range(n):
        found = index.get(keys[i])
        if found is None:
            s[i] = -1
            all_present = False
            continue
        slot = found
        if not 0 <= slot < capacity:
            raise IndexError(f"slot {slot} of key {i} is outside the pool")
        s[i] = slot
    for i in range(n):
        if s[i] >= 0:
            pins[s[i]] += 1
            c[i] = checksums[s[i]]
    return slots, sums, all_present


def unpin_slots(int64_t[::1] pins not None, const int64_t[::1] slots not None):
    """Drops the pin :func:`pin_slots` took on each slot (slots < 0 were absent: skipped)."""
    cdef Py_ssize_t i, capacity = pins.shape[0]
    for i in range(slots.shape[0]):
        if 0 <= slots[i] < capacity:
            pins[slots[i]] -= 1


cdef int _compare_int64(const void *a, const void *b) noexcept nogil:
    cdef int64_t x = (<const int64_t *> a)[0], y = (<const int64_t *> b)[0]
    return (x > y) - (x < y)


def block_ids_status(const int64_t[::1] ids not None, int64_t limit):
    """0 when every id is in 0..limit-1 and none repeats, 1 when one is out of range, 2 when one
    repeats: one pass and a sorted copy, where numpy's min, max and unique cost ~30 us each
    right after a model step. The caller words the error."""
    cdef Py_ssize_t n = ids.shape[0], i
    cdef int status = 0
    for i in range(n):
        if ids[i] < 0 or ids[i] >= limit:
            return 1
    if n < 2:
        return 0
    cdef int64_t *ordered = <int64_t *> PyMem_Malloc(n * sizeof(int64_t))
    if ordered == NULL:
        raise MemoryError()
    memcpy(ordered, &ids[0], n * sizeof(int64_t))
    with nogil:
        qsort(ordered, n, sizeof(int64_t), _compare_int64)
        for i in range(1, n):
            if ordered[i] == ordered[i - 1]:
                status = 2
                break
    PyMem_Free(ordered)
    return status


cdef extern from "tpusync/blake2b.h" nogil:
    ctypedef struct tps_blake2b:
        size_t digest_bytes
    int tps_blake2b_init(tps_blake2b *state, size_t digest_bytes, const void *key,
                         size_t key_bytes, const void *person, size_t person_bytes)
    void tps_blake2b_update(tps_blake2b *state, const void *data, size_t n)
    void tps_blake2b_final(tps_blake2b *state, unsigned char *out)
    void tps_blake2b_chain(const tps_blake2b *prefix, const unsigned char *start,
                           const unsigned char *data, size_t step, size_t n, unsigned char *out)


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
    size), as the ``blake2b-chain-v1`` key scheme computes block keys (tpusync/kv/keys.py).
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


cdef void *_map_huge_aligned(size_t length, int flags, int fd) noexcept nogil:
    """mmap at a 2 MiB boundary: only there can the kernel back the memory with huge pages
    (for a file, the page-cache offset 0 must meet such a boundary too; the mapping starts at
    offset 0). Reserves a larger range without memory, maps into it, returns the rest."""
    cdef size_t span = length + HUGE_PAGE
    cdef char *reserved = <char *> mmap(NULL, span, PROT_NONE,
                                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0)
    if <void *> reserved == MAP_FAILED:
        return mmap(NULL, length, PROT_READ | PROT_WRITE, flags, fd, 0)
    cdef char *aligned = <char *> ((<uintptr_t> reserved + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE)
    cdef void *address = mmap(aligned, length, PROT_READ | PROT_WRITE, flags | MAP_FIXED, fd, 0)
    if address == MAP_FAILED:
        munmap(reserved, span)
        return MAP_FAILED
    if aligned > reserved:
        munmap(reserved, aligned - reserved)
    if reserved + span > aligned + length:
        munmap(aligned + length, reserved + span - (aligned + length))
    return address


cdef class Mapping:
    """Page-aligned memory from ``mmap``, exposed through the buffer protocol.

    Anonymous private memory by default; with ``fd`` (an open file descriptor, e.g. of a file
    in /dev/shm), a shared mapping of that file from offset 0, which other processes mapping the
    same file see. With ``huge_pages`` (and 2 MiB or more) it starts on a 2 MiB boundary and is
    advised for transparent huge pages. The mapping is removed when the object is closed or
    collected. :meth:`close` refuses while buffer views (e.g. numpy arrays over it) are alive.
    """

    cdef void *_address
    cdef readonly size_t size
    cdef int _exports
    # Called as on_unmap(address, size) just before the memory is unmapped (e.g. to undo a DMA
    # registration with a device runtime); then cleared.
    cdef public object on_unmap

    def __cinit__(self, size_t size, bint populate=True, bint huge_pages=False, int fd=-1):
        if size == 0:
            raise ValueError("size must be > 0")
        cdef size_t page = PAGE_SIZE
        cdef size_t mapped = (size + page - 1) // page * page
        cdef void *address
        cdef int flags = MAP_SHARED if fd >= 0 else MAP_PRIVATE | MAP_ANONYMOUS
        with nogil:
            if huge_pages and mapped >= HUGE_PAGE:
                address = _map_huge_aligned(mapped, flags, fd)
            else:
                address = mmap(NULL, mapped, PROT_READ | PROT_WRITE, flags, fd, 0)
        if address == MAP_FAILED:
            raise MemoryError(f"mmap of {mapped} bytes failed: {strerror(errno).decode()}")
        self._address = address
        self.size = mapped
        if huge_pages:
            # advisory (failure is harmless); a shared file's pages also need collapsing
            # (collapse_huge_pages) where its filesystem does not allocate huge pages itself
            madvise(address, mapped, MADV_HUGEPAGE)
        if populate:
            self.populate()

    def populate(self, size_t start=0, length=None, *, bint write=True):
        """Maps every page of [start, start + length) (default: all), for writing (allocating
        fresh pages) or, with ``write=False``, for reading pages that exist (a re-attached shared
        file), so later copies do not pay page faults. GIL released."""
        if self._address == NULL:
            raise ValueError("the mapping is closed")
        cdef size_t n = self.size - start if length is None else length
        if start > self.size or n > self.size - start:
            raise ValueError(f"range {start}+{n} is outside the mapping of {self.size} bytes")
        cdef volatile char *p = <volatile char *> self._address
        cdef size_t i
        cdef size_t page = PAGE_SIZE
        cdef size_t end = start + n
        cdef size_t first = start - start % page
        cdef int done = 0
        with nogil:
            if n:
                done = madvise(<void *> (<char *> self._address + first), end - first,
                               MADV_POPULATE_WRITE_ if write else MADV_POPULATE_READ_) == 0
            i = first
            while not done and i < end:  # old kernels: a write touch maps either way
                p[i] = p[i]
                i += page

    @property
    def address(self):
        """The integer address of the first byte (0 once closed)."""
        return <uintptr_t> self._address

    @property
    def closed(self):
        return self._address == NULL

    def close(self):
        """Unmaps the memory; raises ``BufferError`` while views of it are alive."""
        if self._address == NULL:
            return
        if self._exports:
            raise BufferError(f"{self._exports} buffer views of this memory are still alive")
        hook, self.on_unmap = self.on_unmap, None
        if hook is not None:
            hook(<uintptr_t> self._address, self.size)
        munmap(self._address, self.size)
        self._address = NULL

    def __getbuffer__(self, Py_buffer *buffer, int flags):
        if self._address == NULL:
            raise ValueError("the mapping is closed")
        PyBuffer_FillInfo(buffer, self, self._address, <Py_ssize_t> self.size, 0, flags)
        self._exports += 1

    def __releasebuffer__(self, Py_buffer *buffer):
        self._exports -= 1

    def __dealloc__(self):
        if self._address != NULL:
            hook, self.on_unmap = self.on_unmap, None
            if hook is not None:
                try:
                    hook(<uintptr_t> self._address, self.size)
                except BaseException:  # nothing can be raised from here; unmap regardless
                    pass
            munmap(self._address, self.size)
            self._address = NULL

include "_pjrt_api.pxi"


cdef extern from "poll.h" nogil:
    struct pollfd:
        int fd
        short events
        short revents
    int poll(pollfd *fds, unsigned long nfds, int timeout)
    short POLLIN

cdef extern from "sys/socket.h" nogil:
    ssize_t recv(int sockfd, void *buf, size_t length, int flags)
    struct msghdr:
        void *msg_name
        unsigned int msg_namelen
        iovec *msg_iov
        size_t msg_iovlen
        void *msg_control
        size_t msg_controllen
        int msg_flags
    ssize_t sendmsg(int sockfd, const msghdr *msg, int flags)
    ssize_t recvmsg(int sockfd, msghdr *msg, int flags)
    int MSG_NOSIGNAL
    int MSG_DONTWAIT
    int setsockopt(int sockfd, int level, int optname, const void *optval, unsigned int optlen)
    int SOL_SOCKET
    int SO_RCVLOWAT

cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "errno.h":
    int EINTR
    int EAGAIN
    int EWOULDBLOCK

cdef extern from "poll.h" nogil:
    short POLLOUT


cdef int _retry_after(pollfd *pfd, int timeout_ms) noexcept nogil:
    """After a socket call failed with ``errno``: 1 to try it again (interrupted, or the socket
    is ready now), 0 when ``timeout_ms`` passed with the socket still not ready, -1 for a real
    error (``errno`` kept)."""
    cdef int saved = errno
    if saved == EINTR:
        return 1
    if saved != EAGAIN and saved != EWOULDBLOCK:
        return -1
    cdef int r = poll(pfd, 1, timeout_ms)
    if r < 0:
        return 1 if errno == EINTR else -1
    return 1 if r > 0 else 0


cdef class PieceHasher:
    """The piece checksums (``sum64``) of one block's bytes as they arrive, piece by piece, so
    that each piece is hashed while its bytes are still in cache (fed by :func:`recv_exact`).

    ``offsets`` and ``lengths`` are the pieces' places in the block (a layout's piece table,
    sorted, not overlapping); bytes between pieces are not hashed. :attr:`digests` holds every
    piece's checksum once :attr:`complete`."""

    cdef int64_t[::1] _offsets
    cdef int64_t[::1] _lengths
    cdef uint64_t[::1] _digests
    cdef Py_ssize_t _piece
    cdef int64_t _position
    cdef tps_sum64_state _state
    cdef readonly object digests

    def __cinit__(self, offsets, lengths):
        self._offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        self._lengths = np.ascontiguousarray(lengths, dtype=np.int64)
        if self._offsets.shape[0] != self._lengths.shape[0]:
            raise ValueError("offsets and lengths differ in length")
        self.digests = np.zeros(self._offsets.shape[0], dtype=np.uint64)
        self._digests = self.digests
        self._piece = 0
        self._position = 0
        tps_sum64_init(&self._state)

    @property
    def position(self):
        """How many of the block's bytes were fed."""
        return self._position

    @property
    def complete(self):
        """Whether every piece was hashed."""
        return self._piece == self._offsets.shape[0]

    def feed(self, data):
        """Feeds the block's next bytes (for tests and the paths that receive in Python)."""
        cdef const unsigned char[::1] view = memoryview(data).cast("B")
        if view.shape[0]:
            with nogil:
                self._feed(&view[0], view.shape[0])

    cdef void _reset(self) noexcept nogil:
        """Starts over for the next block (the digests are overwritten piece by piece)."""
        self._piece = 0
        self._position = 0
        tps_sum64_init(&self._state)

    cdef void _feed(self, const unsigned char *data, int64_t n) noexcept nogil:
        """``data`` holds the block's bytes [position, position + n)."""
        cdef int64_t end = self._position + n, start, stop, lo, hi
        while self._piece < self._offsets.shape[0]:
            start = self._offsets[self._piece]
            stop = start + self._lengths[self._piece]
            lo = start if start > self._position else self._position
            hi = stop if stop < end else end
            if hi > lo:
                tps_sum64_update(&self._state, data + (lo - self._position), <size_t>(hi - lo))
            if stop > end:
                break  # the rest of this piece comes later
            self._digests[self._piece] = tps_sum64_digest(&self._state)
            tps_sum64_init(&self._state)
            self._piece += 1
        self._position = end


def send_all(int fd, buffers, double timeout_s):
    """Sends every buffer in order with ``sendmsg`` on the socket ``fd`` (no joining copy), the
    GIL released for the whole loop, waiting at most ``timeout_s`` each time the socket is full.
    Works on blocking and non-blocking sockets. Returns the bytes sent; raises TimeoutError when
    the peer took nothing for ``timeout_s``, OSError for a socket error."""
    views = [memoryview(b).cast("B") for b in buffers]
    views = [v for v in views if v.nbytes]
    cdef Py_ssize_t count = len(views), i, first = 0
    if count == 0:
        return 0
    cdef iovec *iov = <iovec *> PyMem_Malloc(count * sizeof(iovec))
    if iov == NULL:
        raise MemoryError()
    cdef const unsigned char[::1] v
    cdef size_t total = 0, sent = 0
    cdef ssize_t k = 0
    cdef int r = 0, status = 0, err = 0
    cdef int timeout_ms = <int>(timeout_s * 1000.0) if timeout_s < 2e6 else 2000000000
    cdef msghdr msg
    cdef pollfd pfd
    try:
        for i in range(count):
            v = views[i]
            iov[i].iov_base = <void *> &v[0]
            iov[i].iov_len = v.shape[0]
            total += v.shape[0]
        memset(&msg, 0, sizeof(msg))
        pfd.fd = fd
        pfd.events = POLLOUT
        with nogil:
            while first < count:
                msg.msg_iov = iov + first
                msg.msg_iovlen = count - first
                k = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT)
                if k < 0:
                    r = _retry_after(&pfd, timeout_ms)
                    if r == 0:
                        status = -2  # timed out
                        break
                    if r < 0:
                        status, err = -1, errno
                        break
                    continue
                sent += <size_t>k
                while first < count and <size_t>k >= iov[first].iov_len:
                    k -= iov[first].iov_len
                    first += 1
                if first < count and k:
                    iov[first].iov_base = <char *> iov[first].iov_base + k
                    iov[first].iov_len -= k
    finally:
        PyMem_Free(iov)
    if status == -2:
        raise TimeoutError(f"the peer took nothing for {timeout_s:g} s")
    if status == -1:
        raise OSError(err, strerror(err).decode())
    return sent


cdef size_t _rcvlowat_max = 256 << 10
# Most bytes one read takes (recv_exact, FrameReceiver). A read of a whole 2 MiB payload copies
# for ~200 us before the kernel reopens the window, so the sender stalls and sleeps; reads of
# 128 KiB keep both ends streaming and the bytes hot for the hash. Measured here, 1 GiB of 2 MiB
# blocks over loopback, one connection, four A/B runs: 2.9-4.05 -> 3.35-4.8 GB/s (+14-21%).
cdef size_t _recv_step = 128 << 10


def _set_recv_step(size_t nbytes):
    """Sets the most bytes one read takes (for tests and A/B runs); returns the previous."""
    global _recv_step
    previous, _recv_step = _recv_step, max(nbytes, 1)
    return previous


def _set_rcvlowat_max(size_t nbytes):
    """How many bytes recv_exact lets arrive before a wait ends (1: every arrival)."""
    global _rcvlowat_max
    _rcvlowat_max = max(nbytes, 1)


cdef int _wait_for_more(int fd, pollfd *pfd, size_t missing, int *lowat,
                        int timeout_ms) noexcept nogil:
    """After a read found nothing: waits (``_retry_after``) until a good part of the ``missing``
    bytes arrived, not each packet -- SO_RCVLOWAT raised to min(missing, _rcvlowat_max), never
    more than is still missing: fewer wake-ups and longer copies. ``lowat`` is the mark now set
    (put it back with ``_reset_lowat``)."""
    cdef int want = <int> (missing if missing < _rcvlowat_max else _rcvlowat_max)
    cdef int saved
    if want != lowat[0]:
        saved = errno  # what _retry_after judges, whatever setsockopt does
        if setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof(int)) == 0:
            lowat[0] = want
        (&errno)[0] = saved  # errno is a macro: written through its address
    return _retry_after(pfd, timeout_ms)


cdef void _reset_lowat(int fd, int lowat) noexcept nogil:
    """Other readers of the socket (and polls) see every byte again."""
    cdef int one = 1
    if lowat != 1:
        setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof(int))


def recv_exact(int fd, buffer, double timeout_s, PieceHasher hasher=None):
    """Receives until ``buffer`` (a writable contiguous buffer) is full from the socket ``fd``,
    waiting at most ``timeout_s`` for each read; the GIL is released for the whole loop (a
    block's payload is one call, not one Python round trip per kernel read). Returns the bytes
    received: all of them, or fewer when the time ran out (then the caller decides whether its
    deadline passed or it waits again for the rest). Raises EOFError when the peer closed the
    connection and OSError for a socket error. Works on blocking and non-blocking sockets.
    With ``hasher``, every byte received is fed to it as it lands (``buffer`` holds the block's
    bytes from ``hasher.position`` on)."""
    cdef unsigned char[::1] view = memoryview(buffer).cast("B")
    cdef size_t n = view.shape[0]
    cdef unsigned char *p = &view[0] if n else NULL
    cdef size_t got = 0
    cdef ssize_t k = 0
    cdef int r = 0, status = 0, err = 0
    cdef int timeout_ms = <int>(timeout_s * 1000.0) if timeout_s < 2e6 else 2000000000
    cdef pollfd pfd
    pfd.fd = fd
    pfd.events = POLLIN
    cdef bint hashing = hasher is not None
    cdef size_t fed = 0
    cdef int lowat = 1
    cdef bint waited_out = False
    with nogil:
        while got < n:
            # read first, wait only when nothing is there: one system call per read while
            # data streams in (MSG_DONTWAIT: never blocks, whatever the socket's mode)
            k = recv(fd, p + got, n - got if n - got < _recv_step else _recv_step, MSG_DONTWAIT)
            if k == 0:
                status = -2
                break
            if k < 0:
                if waited_out:
                    break  # a whole wait and nothing arrived: the caller checks its deadline
                r = _wait_for_more(fd, &pfd, n - got, &lowat, timeout_ms)
                if r < 0:
                    status, err = -1, errno
                    break
                # on a timeout, read once more: bytes below the low mark count as progress
                waited_out = r == 0
                continue
            waited_out = False
            got += <size_t>k
            if hashing and (got - fed >= HASH_STEP or got == n):
                # hashed while still in cache, in steps long enough for the fast path
                # (4 KiB reads hash at ~8 GB/s, 64 KiB at ~25 here)
                hasher._feed(p + fed, <int64_t>(got - fed))
                fed = got
        if hashing and got > fed:  # timed out mid-step: the hasher keeps up with `got`
            hasher._feed(p + fed, <int64_t>(got - fed))
        _reset_lowat(fd, lowat)
    if status == -2:
        raise EOFError("connection closed by the peer")
    if status == -1:
        raise OSError(err, strerror(err).decode())
    return got


FRAME_HEADER_BYTES = 96
FRAMES_DONE, FRAMES_HEADER, FRAMES_TIMEOUT, FRAMES_SILENT = 0, 1, 2, 3
cdef enum:
    _FRAMES_DONE = 0
    _FRAMES_HEADER = 1
    _FRAMES_TIMEOUT = 2
    _FRAMES_SILENT = 3


cdef extern from "time.h" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk_id, timespec *tp)
    int CLOCK_MONOTONIC


cdef double _monotonic() noexcept nogil:
    cdef timespec t
    clock_gettime(CLOCK_MONOTONIC, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef void _block_header(unsigned char *out, uint64_t request_id, const unsigned char *key,
                        size_t key_len, const unsigned char *fingerprint, uint64_t length,
                        uint16_t scheme, uint64_t checksum) noexcept nogil:
    """The 96 bytes of a BLOCK frame header (cluster/wire.py lays the format out)."""
    cdef uint16_t version = 1, frame_type = 1
    cdef uint8_t n = <uint8_t> key_len
    cdef uint32_t crc
    memset(out, 0, 96)
    memcpy(out, b"TPSB", 4)
    memcpy(out + 4, &version, 2)
    memcpy(out + 6, &frame_type, 2)
    memcpy(out + 8, &request_id, 8)
    memcpy(out + 16, &n, 1)
    memcpy(out + 17, key, key_len)
    memcpy(out + 49, fingerprint, 16)
    memcpy(out + 65, &length, 8)
    memcpy(out + 73, &scheme, 2)
    memcpy(out + 75, &checksum, 8)
    crc = tps_crc32c(0, out, 92)
    memcpy(out + 92, &crc, 4)


def block_frame_headers(uint64_t request_id, list keys not None, bytes fingerprint not None,
                        uint64_t payload_length, const uint64_t[::1] checksums not None,
                        int scheme):
    """The BLOCK frame headers of ``keys`` (each with its checksum), joined: what
    :class:`FrameReceiver` expects, built as ``wire.encode_header`` builds them."""
    cdef Py_ssize_t n = len(keys), i
    if checksums.shape[0] != n or len(fingerprint) != 16:
        raise ValueError("one checksum per key and a 16-byte fingerprint")
    out = bytearray(96 * n)
    cdef unsigned char[::1] view = out
    cdef bytes key
    for i in range(n):
        key = keys[i]
        if not 1 <= len(key) <= 32:
            raise ValueError("keys are 1 to 32 bytes")
        _block_header(&view[96 * i], request_id, key, len(key), fingerprint, payload_length,
                      <uint16_t> scheme, checksums[i])
    return bytes(out)


cdef class FrameReceiver:
    """Receives one response's BLOCK frames straight into their slots, with the GIL released
    across blocks: each header must equal, byte for byte, the one expected for its block (its
    key, request id, layout fingerprint, length and recorded checksum); the payload lands in
    the block's slot and is hashed piece by piece as it arrives (:class:`PieceHasher`), and
    the block's checksum is compared with the one recorded. Each payload read also takes the
    next frame's header (a BLOCK payload is always followed by one), one system call less per
    block.

    :meth:`run` stops at a header it did not expect (a MISSING, ERROR or early END frame, a
    damaged header, ...): :attr:`header` holds it and :attr:`index` is its block; the caller
    decodes it and goes on with :meth:`resume`. Once every block arrived, :meth:`run` reads the
    header that follows them (the END frame, for the caller to check).

    ``addresses`` are the slots' payload addresses: the caller keeps that memory mapped and
    writable (and reserved for these blocks) until the receiver is done."""

    cdef int _fd
    cdef Py_ssize_t _n
    cdef bytes _expected
    cdef const uint64_t[::1] _addresses
    cdef const uint64_t[::1] _checksums
    cdef uint64_t _size
    cdef PieceHasher _hasher
    cdef Py_ssize_t _pieces
    cdef unsigned char _header[96]
    cdef size_t _header_got
    cdef uint64_t _payload_got
    cdef uint64_t _fed
    cdef bint _in_payload
    cdef readonly Py_ssize_t index
    cdef readonly object results
    cdef unsigned char[::1] _results
    cdef readonly uint64_t bytes_received
    cdef readonly uint64_t bytes_read

    def __cinit__(self, int fd, bytes expected_headers not None, const uint64_t[::1] addresses,
                  const uint64_t[::1] checksums, uint64_t payload_length, offsets, lengths):
        self._n = addresses.shape[0]
        if len(expected_headers) != 96 * self._n or checksums.shape[0] != self._n:
            raise ValueError("one 96-byte header, address and checksum per block")
        self._fd = fd
        self._expected = expected_headers
        self._addresses = addresses
        self._checksums = checksums
        self._size = payload_length
        self._hasher = PieceHasher(offsets, lengths)
        self._pieces = self._hasher._offsets.shape[0]
        self.results = np.zeros(self._n, dtype=np.uint8)  # 1: verified, 2: failed its checksum
        self._results = self.results
        self.index = 0
        self._header_got = 0
        self._in_payload = False
        self.bytes_received = 0  # verified or not, whole payloads
        self.bytes_read = 0  # everything read from the socket

    @property
    def header(self):
        """The header :meth:`run` stopped at (96 bytes), or the END frame's after the last
        block."""
        return PyBytes_FromStringAndSize(<char *> self._header, 96)

    def resume(self, Py_ssize_t index):
        """Goes on at block ``index`` (0..blocks), reading its header first: after the caller
        handled the frame :meth:`run` stopped at (and, for a BLOCK frame it took itself, its
        payload)."""
        if not 0 <= index <= self._n:
            raise ValueError(f"index {index} is outside 0..{self._n}")
        self.index = index
        self._header_got = 0
        self._in_payload = False

    def run(self, double budget_s, double silence_s):
        """Receives until every block and the header after them arrived (FRAMES_DONE), a
        header differs from the one expected (FRAMES_HEADER), ``budget_s`` passed
        (FRAMES_TIMEOUT: the caller checks its deadline and calls again to go on), or
        ``silence_s`` passed without a byte (FRAMES_SILENT). Raises EOFError when the peer
        closed the connection and OSError for a socket error."""
        cdef double now = _monotonic()
        cdef double end = now + budget_s, last_byte = now, left
        cdef int timeout_ms
        cdef const unsigned char *expected = self._expected
        cdef pollfd pfd
        pfd.fd = self._fd
        pfd.events = POLLIN
        cdef iovec iov[2]
        cdef msghdr msg
        memset(&msg, 0, sizeof(msg))
        msg.msg_iov = iov
        cdef ssize_t k = 0
        cdef uint64_t missing, take
        cdef int r = 0, status = -1, err = 0, lowat = 1
        cdef bint waited_out = False
        cdef unsigned char *payload
        cdef bint read_some = False
        with nogil:
            while True:
                if read_some:  # data keeps coming: still hand back at the budget
                    read_some = False
                    last_byte = _monotonic()
                    if last_byte >= end:
                        status = _FRAMES_TIMEOUT
                        break
                if not self._in_payload:
                    if self._header_got == 96:
                        if self.index == self._n:
                            status = _FRAMES_DONE
                            break
                        if memcmp(self._header, expected + 96 * self.index, 96) != 0:
                            status = _FRAMES_HEADER
                            break
                        self._in_payload = True
                        self._payload_got = 0
                        self._fed = 0
                        self._header_got = 0
                        self._hasher._reset()
                        continue
                    missing = 96 - self._header_got
                    k = recv(self._fd, self._header + self._header_got, missing, MSG_DONTWAIT)
                else:
                    payload = <unsigned char *> <uintptr_t> self._addresses[self.index]
                    missing = self._size - self._payload_got
                    iov[0].iov_base = payload + self._payload_got
                    iov[0].iov_len = missing
                    iov[1].iov_base = self._header  # the next frame's header, if it is there
                    iov[1].iov_len = 96
                    msg.msg_iovlen = 2
                    if missing > _recv_step:  # the header only with the payload's end
                        iov[0].iov_len = _recv_step
                        msg.msg_iovlen = 1
                    k = recvmsg(self._fd, &msg, MSG_DONTWAIT)
                if k == 0:
                    status = -2
                    break
                if k < 0:
                    now = _monotonic()
                    if now - last_byte >= silence_s and waited_out:
                        status = _FRAMES_SILENT
                        break
                    if now >= end and waited_out:
                        status = _FRAMES_TIMEOUT
                        break
                    left = last_byte + silence_s - now
                    if end - now < left:
                        left = end - now
                    if left < 0:
                        left = 0
                    timeout_ms = <int>(left * 1000.0) + 1 if left < 2e6 else 2000000000
                    r = _wait_for_more(self._fd, &pfd, missing, &lowat, timeout_ms)
                    if r < 0:
                        status, err = -1, errno
                        break
                    # on a timeout, read once more: bytes below the low mark count as progress
                    waited_out = r == 0
                    continue
                waited_out = False
                self.bytes_read += <uint64_t> k
                read_some = True
                if not self._in_payload:
                    self._header_got += <size_t> k
                    continue
                take = <uint64_t> k if <uint64_t> k < missing else missing
                self._payload_got += take
                self._header_got = <size_t> (<uint64_t> k - take)
                if self._payload_got - self._fed >= HASH_STEP or self._payload_got == self._size:
                    self._hasher._feed(payload + self._fed, <int64_t> (self._payload_got - self._fed))
                    self._fed = self._payload_got
                if self._payload_got == self._size:
                    self._results[self.index] = 1 if (
                        self._hasher._piece == self._pieces
                        and tps_xxh64(&self._hasher._digests[0] if self._pieces else NULL,
                                      <size_t> self._pieces * 8, 0)
                        == self._checksums[self.index]
                    ) else 2
                    self.bytes_received += self._size
                    self.index += 1
                    self._in_payload = False
            _reset_lowat(self._fd, lowat)
        if status == -2:
            raise EOFError("connection closed by the peer")
        if status == -1:
            raise OSError(err, strerror(err).decode())
        return status


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
