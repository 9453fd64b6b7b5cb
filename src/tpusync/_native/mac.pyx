# cython: language_level=3, boundscheck=False, wraparound=False
"""Keyed message authentication of block payloads: Poly1305 (RFC 8439), GIL released."""

from libc.stdint cimport uint8_t, uint64_t

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef extern from "tpusync/poly1305.h" nogil:
    void tps_poly1305(const uint8_t *key, const void *data, size_t n, uint8_t *tag)
    void tps_poly1305_many(const uint8_t *keys, const uint64_t *starts, const uint64_t *lengths,
                           size_t count, uint8_t *tags)


def poly1305(bytes key not None, data):
    """The 16-byte Poly1305 tag of a contiguous buffer under a 32-byte one-time ``key``."""
    if len(key) != 32:
        raise ValueError(f"key: expected 32 bytes, got {len(key)}")
    cdef const unsigned char[::1] view = memoryview(data).cast("B")
    cdef size_t n = view.shape[0]
    cdef const void *p = &view[0] if n else NULL
    cdef const uint8_t *k = key
    cdef uint8_t tag[16]
    with nogil:
        tps_poly1305(k, p, n, tag)
    return bytes(tag[:16])


def poly1305_regions(const uint8_t[:, ::1] keys not None, const uint64_t[::1] starts not None,
                     const uint64_t[::1] lengths not None):
    """The tags (an ``(n, 16)`` uint8 array) of ``n`` memory regions (absolute addresses and
    lengths), region i keyed by ``keys[i]`` (32 bytes). The caller keeps the memory alive."""
    cdef Py_ssize_t n = starts.shape[0]
    if keys.shape[0] != n or lengths.shape[0] != n or (n and keys.shape[1] != 32):
        raise ValueError("keys, starts and lengths: expected n x 32 keys and n starts and lengths")
    cdef cnp.ndarray out = np.empty((n, 16), dtype=np.uint8)
    cdef uint8_t *tags = <uint8_t *> cnp.PyArray_DATA(out)
    if n:
        with nogil:
            tps_poly1305_many(&keys[0, 0], &starts[0], &lengths[0], <size_t> n, tags)
    return out
