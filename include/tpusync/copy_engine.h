/* tpusync copy engine: gather/scatter of byte segments over a small persistent thread pool.
 *
 * Ownership: the engine owns its threads; the caller owns every segment's memory and must keep
 * it alive and unchanged (sources) or unused by others (destinations) until the call returns.
 * tps_engine_copy is blocking and may be called from several threads at once: jobs run one at a
 * time, each spread over all of the engine's threads (the caller's thread is one of them).
 */
#ifndef TPUSYNC_COPY_ENGINE_H
#define TPUSYNC_COPY_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One contiguous copy: nbytes from src to dst. Addresses are integers so that a numpy array of
 * shape (n, 3) and dtype uint64 can be passed straight through. */
typedef struct tps_segment {
  uint64_t src;
  uint64_t dst;
  uint64_t nbytes;
} tps_segment;

typedef struct tps_engine tps_engine;

/* Creates an engine with n_threads >= 1 threads in total (n_threads - 1 workers plus the
 * caller). Returns NULL and sets errno on failure. An engine inherited through fork() runs
 * every job on the calling thread alone: the child makes its own engine to use several. */
tps_engine *tps_engine_create(int n_threads);

/* Stops and joins the workers, then frees the engine. No copy may be in flight. In a forked
 * child (the workers did not survive the fork) it only frees the memory: it never blocks. */
void tps_engine_destroy(tps_engine *engine);

int tps_engine_threads(const tps_engine *engine);

/* Copies every segment; returns the number of bytes copied. Segments must not overlap each
 * other's destinations. Jobs smaller than min_parallel_bytes run on the calling thread alone. */
uint64_t tps_engine_copy(tps_engine *engine, const tps_segment *segments, size_t n_segments,
                         uint64_t min_parallel_bytes);

/* Like tps_engine_copy, and also writes digests[i] = tps_sum64 (checksum.h) of segment i's
 * bytes, computed in the same pass as the copy. Threads take whole segments. */
uint64_t tps_engine_copy_hashed(tps_engine *engine, const tps_segment *segments,
                                size_t n_segments, uint64_t *digests,
                                uint64_t min_parallel_bytes);

/* Writes digests[i] = tps_sum64 of segment i's source bytes; copies nothing. */
void tps_engine_hash(tps_engine *engine, const tps_segment *segments, size_t n_segments,
                     uint64_t *digests, uint64_t min_parallel_bytes);

/* Jobs on the caller's OpenMP team.
 *
 * A process whose compute runs on an OpenMP runtime (PyTorch's CPU operators, vLLM on CPU) keeps
 * that runtime's workers spinning on their cores after every parallel region; the engine's own
 * threads then share those cores with them. tps_openmp_install hands the engine the runtime's
 * entry points of GNU's OpenMP ABI (GOMP_parallel, omp_get_thread_num, omp_get_num_threads:
 * libgomp exports them, and so do LLVM's and Intel's runtimes). tps_openmp_here(1) then makes
 * the calling thread's parallel jobs run as one parallel region of that thread's own team (the
 * team the runtime keeps for it, whose workers are the spinning ones) instead of on the
 * engine's threads; tps_openmp_here(0) turns that off again. It is per thread and returns the
 * previous setting. Engines with one thread, and engines inherited through fork(), still run
 * every job on the calling thread alone. */
typedef void (*tps_gomp_parallel_fn)(void (*fn)(void *), void *data, unsigned num_threads,
                                     unsigned flags);
typedef int (*tps_omp_query_fn)(void);
void tps_openmp_install(tps_gomp_parallel_fn parallel, tps_omp_query_fn thread_num,
                        tps_omp_query_fn num_threads);
int tps_openmp_here(int on);
/* Whether tps_openmp_install has been given a runtime. */
int tps_openmp_installed(void);

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_COPY_ENGINE_H */
