# Declarations of include/tpusync/copy_engine.h (the native gather/scatter engine).
from libc.stdint cimport uint64_t


cdef extern from "tpusync/copy_engine.h" nogil:
    ctypedef struct tps_segment:
        uint64_t src
        uint64_t dst
        uint64_t nbytes

    ctypedef struct tps_engine:
        pass

    tps_engine *tps_engine_create(int n_threads)
    void tps_engine_destroy(tps_engine *engine)
    int tps_engine_threads(const tps_engine *engine)
    uint64_t tps_engine_copy(tps_engine *engine, const tps_segment *segments,
                             size_t n_segments, uint64_t min_parallel_bytes)
    uint64_t tps_engine_copy_hashed(tps_engine *engine, const tps_segment *segments,
                                    size_t n_segments, uint64_t *digests,
                                    uint64_t min_parallel_bytes)
    void tps_engine_hash(tps_engine *engine, const tps_segment *segments, size_t n_segments,
                         uint64_t *digests, uint64_t min_parallel_bytes)

    ctypedef void (*tps_gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads,
                                          unsigned flags)
    ctypedef int (*tps_omp_query_fn)()
    void tps_openmp_install(tps_gomp_parallel_fn parallel, tps_omp_query_fn thread_num,
                            tps_omp_query_fn num_threads)
    int tps_openmp_here(int on)
    int tps_openmp_installed()
