# cython: language_level=3, boundscheck=False, wraparound=False
"""Float conversions of weights as they land and the per-channel absolute maxima their fp8
scales are made from (csrc/convert.c), GIL released. Each result is bit for bit XLA's convert
(``jnp.astype``) of the same values."""

import numpy as np

cimport numpy as cnp

cnp.import_array()


cdef extern from "tpusync/convert.h" nogil:
    int TPS_F32, TPS_BF16, TPS_F8E4M3FN, TPS_F8E5M2
    int tps_convert(const void *src, int src_kind, void *dst, int dst_kind, size_t rows,
                    size_t cols, const float *factors, size_t n_factors)
    int tps_channel_amax(const void *src, int src_kind, size_t rows, size_t cols, float *amax)

KINDS = {"float32": TPS_F32, "bfloat16": TPS_BF16, "float8_e4m3fn": TPS_F8E4M3FN,
         "float8_e5m2": TPS_F8E5M2}
SOURCES = ("float32", "bfloat16")


cdef int _kind(cnp.ndarray array, str argument, tuple allowed) except -1:
    name = array.dtype.name
    if name not in allowed:
        raise ValueError(f"{argument}: expected one of {allowed}, got {name}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{argument}: expected a C-contiguous array")
    return KINDS[name]


cdef tuple _rows_cols(cnp.ndarray array):
    cdef size_t cols = array.shape[array.ndim - 1] if array.ndim else 1
    return (<size_t> array.size // cols if cols else 0), cols


def convert(cnp.ndarray src not None, cnp.ndarray dst not None,
            const float[::1] factors not None):
    """Writes ``src`` (float32 or bfloat16) into ``dst`` of another float dtype and the same
    shape (fp8: each value multiplied first by ``factors[0]``, or by its last-axis column's
    factor when ``factors`` has one per column: the inverses of the scales)."""
    cdef int src_kind = _kind(src, "src", SOURCES)
    cdef int dst_kind = _kind(dst, "dst", tuple(KINDS))
    src_shape, dst_shape = (<object> src).shape, (<object> dst).shape
    if src_shape != dst_shape:
        raise ValueError(f"dst: shape {dst_shape} is not src's {src_shape}")
    if not dst.flags.writeable:
        raise ValueError("dst: read-only")
    rows, cols = _rows_cols(src)
    cdef size_t n_rows = rows, n_cols = cols, n_factors = factors.shape[0]
    if n_factors != 1 and n_factors != n_cols:
        raise ValueError(f"factors: expected 1 or {n_cols} (one per column), got {n_factors}")
    if not src.size:
        return
    cdef const void *s = cnp.PyArray_DATA(src)
    cdef void *d = cnp.PyArray_DATA(dst)
    cdef int rc
    with nogil:
        rc = tps_convert(s, src_kind, d, dst_kind, n_rows, n_cols, &factors[0], n_factors)
    if rc:
        raise ValueError(f"cannot convert {(<object> src).dtype} to {(<object> dst).dtype}")


def channel_amax(cnp.ndarray src not None, float[::1] amax not None):
    """Folds ``src``'s absolute maxima per last-axis column into ``amax`` (one per column; a
    NaN stays NaN)."""
    cdef int src_kind = _kind(src, "src", SOURCES)
    rows, cols = _rows_cols(src)
    cdef size_t n_rows = rows, n_cols = cols
    if <size_t> amax.shape[0] != n_cols:
        raise ValueError(f"amax: expected {n_cols} (one per column), got {amax.shape[0]}")
    if not src.size:
        return
    cdef const void *s = cnp.PyArray_DATA(src)
    with nogil:
        tps_channel_amax(s, src_kind, n_rows, n_cols, &amax[0])
