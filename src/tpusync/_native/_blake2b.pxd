# Declarations of include/tpusync/blake2b.h (keyed BLAKE2b and the block-key chain).


cdef extern from "tpusync/blake2b.h" nogil:
    ctypedef struct tps_blake2b:
        size_t digest_bytes
    int tps_blake2b_init(tps_blake2b *state, size_t digest_bytes, const void *key,
                         size_t key_bytes, const void *person, size_t person_bytes)
    void tps_blake2b_update(tps_blake2b *state, const void *data, size_t n)
    void tps_blake2b_final(tps_blake2b *state, unsigned char *out)
    void tps_blake2b_chain(const tps_blake2b *prefix, const unsigned char *start,
                           const unsigned char *data, size_t step, size_t n, unsigned char *out)
