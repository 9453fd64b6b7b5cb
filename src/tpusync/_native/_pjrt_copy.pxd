# Declarations of include/tpusync/pjrt_copy.h: block copies between host memory and device
# buffers through a PJRT plugin (tps_pjrt_copy), completed from the plugin's event callbacks.
from tpusync._native._pjrt_min cimport (
    PJRT_Api, PJRT_Buffer, PJRT_RawBuffer, PJRT_RawBuffer_Extension,
)


cdef extern from "tpusync/pjrt_copy.h" nogil:
    ctypedef struct tps_pjrt_target:
        unsigned long long base
        unsigned long long size
        PJRT_Buffer *buffer
        PJRT_RawBuffer *raw

    # rows: a C-contiguous uint64 (n, 3) segment table, as for the CPU copy engine
    int tps_pjrt_copy(const PJRT_Api *api, const PJRT_RawBuffer_Extension *raw_ext,
                      const tps_pjrt_target *targets, size_t n_targets, const void *rows,
                      size_t n_rows, char *message, size_t message_size, size_t *issued)
