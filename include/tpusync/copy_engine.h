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

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_COPY_ENGINE_H */
