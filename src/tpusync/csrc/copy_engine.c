/* Gather/scatter of byte segments over a persistent pthread pool (see copy_engine.h). */
#include "tpusync/copy_engine.h"

#include "tpusync/checksum.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TPS_HAVE_STREAMING 1
#endif

typedef struct tps_job {
  const tps_segment *segments;
  size_t n_segments;
  uint64_t total_bytes;
  int n_parts;
  int streaming; /* non-temporal stores: the job is larger than the caches */
  uint64_t *digests;             /* hashed jobs: one tps_sum64 per segment, else NULL */
  int hash_only;                 /* hashed jobs that only read their sources */
  atomic_size_t *next_segment;   /* hashed jobs hand out whole segments */
  size_t batch;                  /* ... this many at a time */
} tps_job;

/* Jobs at least this large bypass the caches with non-temporal stores. glibc only does so for
 * single copies above ~3/4 of the last-level cache, so a large job made of many blocks would
 * otherwise pay a read-for-ownership of every destination line (docs/decisions/0001). */
#define TPS_STREAMING_MIN_JOB (8u << 20)
#define TPS_STREAMING_MIN_PIECE 4096u
/* Hashed jobs hand out segments a few at a time, so that each knows the next one its thread
 * reads (and prefetches it while finishing) and four run at once (tps_sum64_pieces): about 1
 * MiB a grab, 4 to 32 segments, fewer near the end so that the threads finish together. */
#define TPS_HASH_BATCH_BYTES (1u << 20)
#define TPS_HASH_BATCH_MAX 32

#if TPS_HAVE_STREAMING
/* 64 bytes from src to dst with non-temporal stores (dst 16-byte aligned). */
static inline void stream_64(char *dst, const char *src) {
  __m128i a = _mm_loadu_si128((const __m128i *)src);
  __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
  __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
  __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
  _mm_stream_si128((__m128i *)dst, a);
  _mm_stream_si128((__m128i *)(dst + 16), b);
  _mm_stream_si128((__m128i *)(dst + 32), c);
  _mm_stream_si128((__m128i *)(dst + 48), d);
}

/* Streams 16 KiB as four interleaved 4 KiB pages, 128 bytes of each in turn, prefetching ahead.
 * Reading four pages at once keeps more lines in flight than one sequential stream (0001). */
static inline void stream_4_pages(char *dst, const char *src) {
  const uint64_t page = 4096;
  for (uint64_t offset = 0; offset < page; offset += 128) {
    for (uint64_t k = 0; k < 4; k++) {
      const char *s = src + k * page + offset;
      char *d = dst + k * page + offset;
      _mm_prefetch(s + 256, _MM_HINT_T0);
      _mm_prefetch(s + 320, _MM_HINT_T0);
      stream_64(d, s);
      stream_64(d + 64, s + 64);
    }
  }
}

/* The same with 64-byte vectors, every load of a step before its stores (as glibc's large
 * copies): faster than the 16-byte loop on scattered blocks (docs/decisions/0001). */
__attribute__((target("avx512f"))) static void stream_4_pages_512(char *dst, const char *src,
                                                                  uint64_t n_chunks) {
  const uint64_t page = 4096;
  for (uint64_t c = 0; c < n_chunks; c++, src += 4 * page, dst += 4 * page) {
    for (uint64_t offset = 0; offset < page; offset += 128) {
      __m512i v[8];
      for (uint64_t k = 0; k < 4; k++) {
        _mm_prefetch(src + k * page + offset + 128, _MM_HINT_T0);
        _mm_prefetch(src + k * page + offset + 192, _MM_HINT_T0);
      }
      for (uint64_t k = 0; k < 4; k++) {
        v[2 * k] = _mm512_loadu_si512(src + k * page + offset);
        v[2 * k + 1] = _mm512_loadu_si512(src + k * page + offset + 64);
      }
      for (uint64_t k = 0; k < 4; k++) {
        _mm512_stream_si512((void *)(dst + k * page + offset), v[2 * k]);
        _mm512_stream_si512((void *)(dst + k * page + offset + 64), v[2 * k + 1]);
      }
    }
  }
}

/* AVX-512 from Ice Lake and Zen 4 on (VPCLMULQDQ marks them): earlier Xeons slow the core's
 * clock for 64-byte vectors, as glibc avoids them there. */
static int have_avx512(void) {
  static int cached = -1;
  if (cached < 0)
    cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") ? 1 : 0;
  return cached;
}

static void copy_streaming(char *dst, const char *src, uint64_t n) {
  uint64_t head = (uint64_t)(-(uintptr_t)dst) & 63u; /* align stores to a cache line */
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  uint64_t i = 0;
  if (have_avx512()) {
    stream_4_pages_512(dst, src, n / 16384);
    i = n / 16384 * 16384;
  }
  for (; i + 16384 <= n; i += 16384) stream_4_pages(dst + i, src + i);
  for (; i + 64 <= n; i += 64) stream_64(dst + i, src + i);
  memcpy(dst + i, src + i, n - i);
}
#endif

static void copy_piece(const tps_job *job, char *dst, const char *src, uint64_t n) {
#if TPS_HAVE_STREAMING
  if (job->streaming && n >= TPS_STREAMING_MIN_PIECE) {
    copy_streaming(dst, src, n);
    return;
  }
#else
  (void)job;
#endif
  memcpy(dst, src, n);
}

/* Fork safety. A child of fork() inherits an engine's memory but none of its worker threads:
 * joining them, destroying the condition variable they waited on (glibc waits for its waiters
 * to leave) or taking a lock one of them held would block the child forever. So every fork
 * bumps this count in the child (pthread_atfork), and an engine made before the last fork is
 * *inherited*: it runs each job on the calling thread alone, and destroy frees its memory
 * without touching its threads, locks or condition variables (the dead threads' stacks are
 * the C library's to reclaim). */
static atomic_uint_fast64_t forks_seen;
static pthread_once_t fork_handler_once = PTHREAD_ONCE_INIT;

static void count_fork_in_child(void) { atomic_fetch_add(&forks_seen, 1); }

static void install_fork_handler(void) { pthread_atfork(NULL, NULL, count_fork_in_child); }

struct tps_engine {
  uint_fast64_t forks_at_create; /* forks_seen when the threads were started */
  int n_threads;
  pthread_t *workers;
  pthread_mutex_t submit_lock; /* one job at a time */
  pthread_mutex_t lock;        /* guards everything below */
  pthread_cond_t wake;
  pthread_cond_t finished;
  uint64_t generation; /* bumped for each job handed to the workers */
  int pending_parts;
  int stop;
  tps_job job;
};

typedef struct tps_worker_arg {
  tps_engine *engine;
  int part;
} tps_worker_arg;

/* Copies bytes [begin, end) of the concatenation of all segments. Splitting by bytes, not by
 * segments, balances the threads whatever the mix of segment sizes. */
static void copy_byte_range(const tps_job *job, uint64_t begin, uint64_t end) {
  uint64_t seg_start = 0;
  for (size_t i = 0; i < job->n_segments && seg_start < end; i++) {
    const tps_segment *s = &job->segments[i];
    uint64_t seg_end = seg_start + s->nbytes;
    if (seg_end > begin) {
      uint64_t lo = begin > seg_start ? begin - seg_start : 0;
      uint64_t hi = (end < seg_end ? end : seg_end) - seg_start;
      copy_piece(job, (char *)(uintptr_t)s->dst + lo, (const char *)(uintptr_t)s->src + lo,
                 hi - lo);
    }
    seg_start = seg_end;
  }
}

/* Checksums and copies one segment in 24 KiB steps: each step is checksummed from the source,
 * then copied while it is still in the cache, so the data crosses the memory bus once. The
 * checksum (tps_sum64) is of the bytes that were copied. */
static void copy_hash_segment(const tps_job *job, size_t index, const void *next) {
  const tps_segment *s = &job->segments[index];
  const char *src = (const char *)(uintptr_t)s->src;
  char *dst = (char *)(uintptr_t)s->dst;
  tps_sum64_state state;
  tps_sum64_init(&state);
  if (job->hash_only) {
    tps_sum64_update(&state, src, s->nbytes);
    job->digests[index] = tps_sum64_digest(&state);
    return;
  }
#if TPS_HAVE_STREAMING
  /* Large jobs: one loop that loads, checksums and streams each line (no second read). */
  if (job->streaming && tps_sum64_copy_streaming_next(&state, dst, src, s->nbytes, next)) {
    job->digests[index] = tps_sum64_digest(&state);
    return;
  }
#else
  (void)next;
#endif
  const uint64_t step = 24576; /* a multiple of the checksum's 24-byte groups */
  for (uint64_t offset = 0; offset < s->nbytes; offset += step) {
    uint64_t n = s->nbytes - offset < step ? s->nbytes - offset : step;
    tps_sum64_update(&state, src + offset, n);
    copy_piece(job, dst + offset, src + offset, n);
  }
  job->digests[index] = tps_sum64_digest(&state);
}

/* Segments [begin, end) of a hashed job: runs of those tps_sum64_pieces takes (destinations
 * 8-byte aligned, large jobs: non-temporal stores), the others one by one. */
static void hash_segments(const tps_job *job, size_t begin, size_t end) {
  const void *src[TPS_HASH_BATCH_MAX];
  void *dst[TPS_HASH_BATCH_MAX];
  size_t n[TPS_HASH_BATCH_MAX];
  size_t i = begin;
  while (i < end) {
    size_t count = 0;
    if (job->hash_only || job->streaming)
      for (; i + count < end; count++) {
        const tps_segment *s = &job->segments[i + count];
        if (!job->hash_only && s->dst % 8 != 0) break;
        src[count] = (const void *)(uintptr_t)s->src;
        dst[count] = (void *)(uintptr_t)s->dst;
        n[count] = s->nbytes;
      }
    const void *next =
        i + count < end ? (const void *)(uintptr_t)job->segments[i + count].src : NULL;
    if (count &&
        tps_sum64_pieces(count, src, job->hash_only ? NULL : dst, n, job->digests + i, next)) {
      i += count;
      continue;
    }
    if (!count) count = 1; /* an unaligned destination: the general path */
    for (size_t k = i; k < i + count; k++) {
      const void *after = k + 1 < end ? (const void *)(uintptr_t)job->segments[k + 1].src : NULL;
      copy_hash_segment(job, k, after);
    }
    i += count;
  }
}

static void run_part(const tps_job *job, int part) {
  if (job->digests) {
    size_t index = atomic_load(job->next_segment);
    for (;;) {
      if (index >= job->n_segments) break;
      /* near the end, at most a quarter of what is left each, whole fours while they last */
      size_t left = job->n_segments - index, take = job->batch;
      size_t share = left / (4 * (size_t)job->n_parts);
      if (take > share) take = share >= 4 ? share / 4 * 4 : share ? share : 1;
      if (!atomic_compare_exchange_weak(job->next_segment, &index, index + take)) continue;
      hash_segments(job, index, index + take);
      index = atomic_load(job->next_segment);
    }
#if TPS_HAVE_STREAMING
    if (job->streaming) _mm_sfence();
#endif
    return;
  }
  /* Part boundaries rounded to 4 KiB keep every thread's stores on its own pages. */
  const uint64_t align = 4096;
  uint64_t per = job->total_bytes / (uint64_t)job->n_parts;
  per = (per + align - 1) / align * align;
  uint64_t begin = per * (uint64_t)part;
  uint64_t end = part == job->n_parts - 1 ? job->total_bytes : begin + per;
  if (begin >= job->total_bytes) return;
  if (end > job->total_bytes) end = job->total_bytes;
  copy_byte_range(job, begin, end);
#if TPS_HAVE_STREAMING
  if (job->streaming) _mm_sfence(); /* streaming stores are visible before the part reports */
#endif
}

/* Whether this process is a forked child of the one that started the engine's threads. */
static int inherited(const tps_engine *e) {
  return e->forks_at_create != atomic_load_explicit(&forks_seen, memory_order_relaxed);
}

static void *worker_main(void *p) {
  tps_worker_arg arg = *(tps_worker_arg *)p;
  free(p);
  tps_engine *e = arg.engine;
  uint64_t seen = 0;
  pthread_mutex_lock(&e->lock);
  for (;;) {
    while (e->generation == seen && !e->stop) pthread_cond_wait(&e->wake, &e->lock);
    if (e->stop) break;
    seen = e->generation;
    tps_job job = e->job;
    pthread_mutex_unlock(&e->lock);
    run_part(&job, arg.part);
    pthread_mutex_lock(&e->lock);
    if (--e->pending_parts == 0) pthread_cond_signal(&e->finished);
  }
  pthread_mutex_unlock(&e->lock);
  return NULL;
}

tps_engine *tps_engine_create(int n_threads) {
  if (n_threads < 1) {
    errno = EINVAL;
    return NULL;
  }
  tps_engine *e = calloc(1, sizeof(*e));
  if (!e) return NULL;
  pthread_once(&fork_handler_once, install_fork_handler);
  e->forks_at_create = atomic_load(&forks_seen);
  e->n_threads = n_threads;
  pthread_mutex_init(&e->submit_lock, NULL);
  pthread_mutex_init(&e->lock, NULL);
  pthread_cond_init(&e->wake, NULL);
  pthread_cond_init(&e->finished, NULL);
  e->workers = calloc((size_t)n_threads, sizeof(pthread_t));
  if (!e->workers) {
    free(e);
    return NULL;
  }
  for (int i = 1; i < n_threads; i++) {
    tps_worker_arg *arg = malloc(sizeof(*arg));
    int rc = ENOMEM;
    if (arg) {
      arg->engine = e;
      arg->part = i;
      rc = pthread_create(&e->workers[i], NULL, worker_main, arg);
    }
    if (rc != 0) {
      free(arg);
      e->n_threads = i; /* destroy joins the ones that started */
      tps_engine_destroy(e);
      errno = rc;
      return NULL;
    }
  }
  return e;
}

void tps_engine_destroy(tps_engine *e) {
  if (!e) return;
  if (inherited(e)) { /* its threads are gone: free the memory only (see forks_seen) */
    free(e->workers);
    free(e);
    return;
  }
  pthread_mutex_lock(&e->lock);
  e->stop = 1;
  pthread_cond_broadcast(&e->wake);
  pthread_mutex_unlock(&e->lock);
  for (int i = 1; i < e->n_threads; i++) pthread_join(e->workers[i], NULL);
  pthread_cond_destroy(&e->wake);
  pthread_cond_destroy(&e->finished);
  pthread_mutex_destroy(&e->lock);
  pthread_mutex_destroy(&e->submit_lock);
  free(e->workers);
  free(e);
}

int tps_engine_threads(const tps_engine *e) { return e->n_threads; }

/* The OpenMP runtime's entry points (tps_openmp_install), set once and read by any thread, and
 * whether this thread's jobs go to its OpenMP team (tps_openmp_here). */
typedef struct tps_openmp {
  tps_gomp_parallel_fn parallel;
  tps_omp_query_fn thread_num;
  tps_omp_query_fn num_threads;
} tps_openmp;
static _Atomic(tps_openmp *) openmp_runtime;
static _Thread_local int openmp_here;

void tps_openmp_install(tps_gomp_parallel_fn parallel, tps_omp_query_fn thread_num,
                        tps_omp_query_fn num_threads) {
  tps_openmp *runtime = malloc(sizeof(*runtime));
  if (!runtime) return; /* the engine's own threads keep the jobs */
  runtime->parallel = parallel;
  runtime->thread_num = thread_num;
  runtime->num_threads = num_threads;
  /* the entry points of a loaded library never move: an earlier record stays valid for a
   * thread still reading it, so it is leaked rather than freed */
  atomic_store(&openmp_runtime, runtime);
}

int tps_openmp_installed(void) { return atomic_load(&openmp_runtime) != NULL; }

int tps_openmp_here(int on) {
  int previous = openmp_here;
  openmp_here = on != 0;
  return previous;
}

typedef struct tps_team_job {
  const tps_job *job;
  const tps_openmp *runtime;
} tps_team_job;

/* One member of the team: the job split into as many parts as the team has threads. */
static void run_team_part(void *arg) {
  const tps_team_job *team = arg;
  tps_job job = *team->job;
  job.n_parts = team->runtime->num_threads();
  run_part(&job, team->runtime->thread_num());
}

static uint64_t run_job(tps_engine *e, const tps_segment *segments, size_t n_segments,
                        uint64_t min_parallel_bytes, uint64_t *digests, int hash_only) {
  atomic_size_t next_segment;
  atomic_init(&next_segment, 0);
  tps_job job = {segments, n_segments, 0, 1, 0, digests, hash_only, &next_segment, 1};
  for (size_t i = 0; i < n_segments; i++) job.total_bytes += segments[i].nbytes;
  job.streaming = !hash_only && job.total_bytes >= TPS_STREAMING_MIN_JOB;
  if (n_segments) {
    uint64_t mean = job.total_bytes / n_segments;
    uint64_t batch = mean ? TPS_HASH_BATCH_BYTES / mean : TPS_HASH_BATCH_MAX;
    batch = batch < 4 ? 4 : batch > TPS_HASH_BATCH_MAX ? TPS_HASH_BATCH_MAX : batch / 4 * 4;
    job.batch = (size_t)batch;
  }
  if (e->n_threads == 1 || job.total_bytes < min_parallel_bytes || inherited(e)) {
    run_part(&job, 0);
    return job.total_bytes;
  }
  const tps_openmp *runtime = openmp_here ? atomic_load(&openmp_runtime) : NULL;
  if (runtime) {
    tps_team_job team = {&job, runtime};
    runtime->parallel(run_team_part, &team, 0, 0); /* 0 threads: the team's own size */
    return job.total_bytes;
  }
  job.n_parts = e->n_threads;
  pthread_mutex_lock(&e->submit_lock);
  pthread_mutex_lock(&e->lock);
  e->job = job;
  e->pending_parts = e->n_threads - 1;
  e->generation++;
  pthread_cond_broadcast(&e->wake);
  pthread_mutex_unlock(&e->lock);
  run_part(&job, 0);
  pthread_mutex_lock(&e->lock);
  while (e->pending_parts > 0) pthread_cond_wait(&e->finished, &e->lock);
  pthread_mutex_unlock(&e->lock);
  pthread_mutex_unlock(&e->submit_lock);
  return job.total_bytes;
}

uint64_t tps_engine_copy(tps_engine *e, const tps_segment *segments, size_t n_segments,
                         uint64_t min_parallel_bytes) {
  return run_job(e, segments, n_segments, min_parallel_bytes, NULL, 0);
}

uint64_t tps_engine_copy_hashed(tps_engine *e, const tps_segment *segments, size_t n_segments,
                                uint64_t *digests, uint64_t min_parallel_bytes) {
  return run_job(e, segments, n_segments, min_parallel_bytes, digests, 0);
}

void tps_engine_hash(tps_engine *e, const tps_segment *segments, size_t n_segments,
                     uint64_t *digests, uint64_t min_parallel_bytes) {
  run_job(e, segments, n_segments, min_parallel_bytes, digests, 1);
}
