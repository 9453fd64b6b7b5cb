# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""tpusync's native core: GIL-free byte movement and page-aligned memory. No policy lives here.

This module holds the memory (page-aligned mappings, huge pages) and the slot pool's pin and id
checks, and re-exports the native extensions of each job (tpusync._native: copy, checksum, net,
fileio, pjrt, convert), so that ``tpusync._native.core`` answers every name of the native core."""

from cpython.buffer cimport PyBuffer_FillInfo
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from libc.errno cimport errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint64_t, uintptr_t
from libc.string cimport memcpy, strerror
from libc.stdlib cimport qsort
from posix.mman cimport (
    MAP_ANONYMOUS, MAP_FAILED, MAP_FIXED, MAP_NORESERVE, MAP_PRIVATE, MAP_SHARED, PROT_NONE,
    PROT_READ, PROT_WRITE, mmap, munmap,
)

cimport numpy as cnp

import os

import numpy as np

from tpusync._native.checksum import (
    _checksum_kernel, _crc32c_shift, _force_portable_checksum, blake2b, blake2b_chain, copy_sum64_streams, crc32c, sum64,
    sum64_regions, xxh64, xxh64_gathered, xxh64_rows,
)
from tpusync._native.convert import channel_amax, convert
from tpusync._native.copy import (
    BlockRows, CopyEngine, block_segments, openmp_here, openmp_install, openmp_installed,
    table_bounds,
)
from tpusync._native.fileio import MAX_IOVS_PER_RUN, file_runs
from tpusync._native.limits import copy_seconds, have_streaming
from tpusync._native.net import (
    FRAME_HEADER_BYTES, FRAMES_DONE, FRAMES_HEADER, FRAMES_SILENT, FRAMES_TIMEOUT, FrameReceiver,
    PieceHasher, _set_rcvlowat_max, _set_recv_step, block_frame_headers, recv_exact, send_all,
)
from tpusync._native.pjrt import (
    PJRT_EXTENSION_TYPE_RAW_BUFFER, PjrtApi, PjrtError, _slot_offsets, _struct_sizes,
    pjrt_minimum_version,
)

# Every name of the native core: this module's and those of tpusync._native it re-exports.
__all__ = [
    "FRAMES_DONE", "FRAMES_HEADER", "MAX_IOVS_PER_RUN", "FRAMES_SILENT", "FRAMES_TIMEOUT", "FRAME_HEADER_BYTES",
    "PAGE_SIZE", "PJRT_EXTENSION_TYPE_RAW_BUFFER", "BlockRows", "CopyEngine", "FrameReceiver",
    "channel_amax", "convert",
    "Mapping", "PieceHasher", "PjrtApi", "PjrtError", "_checksum_kernel", "_crc32c_shift", "_force_portable_checksum",
    "_set_rcvlowat_max", "_set_recv_step", "_slot_offsets", "_struct_sizes", "blake2b",
    "blake2b_chain", "block_frame_headers", "block_ids_status", "block_segments",
    "collapse_huge_pages", "copy_seconds", "dlpack_address", "copy_sum64_streams", "crc32c", "file_runs", "have_streaming", "openmp_here",
    "openmp_install", "openmp_installed", "pin_slots", "pjrt_minimum_version", "populate_range", "recv_exact", "send_all",
    "sum64", "sum64_regions", "table_bounds", "unpin_slots", "xxh64", "xxh64_gathered",
    "xxh64_rows",
]

cnp.import_array()

# Page size of this host; every Mapping starts on a page boundary.
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


cdef extern from *:
    """
    #define TPS_ATOMIC_TOUCH(p) __atomic_fetch_or((char *)(p), 0, __ATOMIC_RELAXED)
    """
    void TPS_ATOMIC_TOUCH(void *p) nogil

cdef extern from "sys/mman.h" nogil:
    int madvise(void *addr, size_t length, int advice)
    int MADV_HUGEPAGE

# Linux >= 5.14: map a range's pages in one call rather than faulting them one by one (older
# kernels answer EINVAL and the range is touched page by page instead). Pages that exist already
# (a re-attached /dev/shm pool) are mapped for reading, which is cheaper: docs/decisions/0001.
cdef int MADV_POPULATE_READ_ = 22
cdef int MADV_POPULATE_WRITE_ = 23
# Linux >= 6.1: back a range with huge pages now, copying its small pages (EINVAL before).
cdef int MADV_COLLAPSE_ = 25
cdef size_t HUGE_PAGE = 2 << 20


cdef int _populate_write = -1  # whether this kernel has MADV_POPULATE_WRITE (-1: not asked)


cdef bint _populate_write_supported():
    """Asks once, on a private page of our own: the kernel answers EINVAL both for advice it
    lacks and for memory it will not populate, so only a page known writable tells them apart."""
    global _populate_write
    cdef void *page
    if _populate_write < 0:
        page = mmap(NULL, PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if page == MAP_FAILED:
            return True  # cannot tell: never touch foreign memory by hand
        _populate_write = madvise(page, PAGE_SIZE, MADV_POPULATE_WRITE_) == 0
        munmap(page, PAGE_SIZE)
    return _populate_write == 1


# The head of DLPack's DLManagedTensor (dlpack.h): a DLTensor.
ctypedef struct _DLTensor:
    void *data
    int32_t device_type
    int32_t device_id
    int32_t ndim
    uint8_t code
    uint8_t bits
    uint16_t lanes
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset


def dlpack_address(object capsule):
    """The address of the first element of an unconsumed DLPack capsule ("dltensor"), or None
    for any other object. While the capsule lives its producer keeps that memory as is."""
    if not PyCapsule_IsValid(capsule, "dltensor"):
        return None
    cdef _DLTensor *tensor = <_DLTensor *> PyCapsule_GetPointer(capsule, "dltensor")
    return <uintptr_t> tensor.data + tensor.byte_offset


def populate_range(uintptr_t address, size_t length):
    """Maps every page of the memory at [address, address + length) for writing, contents
    unchanged (``MADV_POPULATE_WRITE``; on older kernels an atomic or of 0 into each page's
    first byte), so that later copies into memory another library allocated do not pay its
    first-touch page faults. Memory the kernel refuses to populate is left untouched. GIL
    released."""
    cdef size_t page = PAGE_SIZE
    cdef uintptr_t first = address - address % page
    cdef uintptr_t end = address + length
    cdef uintptr_t i
    cdef int done = 0
    if length == 0:
        return
    cdef bint fallback = not _populate_write_supported()
    with nogil:
        done = madvise(<void *> first, end - first, MADV_POPULATE_WRITE_) == 0
        # only a kernel without MADV_POPULATE_WRITE: where it has it, a failure (memory not
        # writable, not mapped: EINVAL as well) is left alone, never touched
        if not done and fallback:
            i = address
            while i < end:
                TPS_ATOMIC_TOUCH(<void *> i)  # a write that keeps the byte
                i = (i - i % page) + page


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
    repeats: one pass and a sorted copy, cheaper than numpy's min, max and unique right after a
    model step (docs/decisions/0004). The caller words the error."""
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
