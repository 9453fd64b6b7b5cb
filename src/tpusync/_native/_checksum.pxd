# Declarations of include/tpusync/checksum.h (XXH64, CRC-32C and the piece checksum sum64).
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "tpusync/checksum.h" nogil:
    uint64_t tps_xxh64(const void *data, size_t n, uint64_t seed)
    uint32_t tps_crc32c(uint32_t crc, const void *data, size_t n)
    uint32_t tps_crc32c_shift(uint32_t crc, uint64_t nbytes)
    uint64_t tps_sum64(const void *data, size_t n)
    ctypedef struct tps_sum64_state:
        uint32_t n_pending  # bytes of a partial group waiting (the other fields: opaque)
    void tps_sum64_init(tps_sum64_state *state)
    void tps_sum64_update(tps_sum64_state *state, const void *data, size_t n)
    uint64_t tps_sum64_digest(const tps_sum64_state *state)
    int tps_sum64_copy_streaming_next(tps_sum64_state *state, void *dst, const void *src, size_t n,
                                      const void *next)
    void tps_checksum_force_portable(int on)
    const char *tps_checksum_kernel()
    int *tps_checksum_path_flag()
    void tps_checksum_share_path_flag(int *flag)
