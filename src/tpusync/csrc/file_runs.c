/* Many preadv/pwritev runs on a few threads, with no Python between them: one call moves a
 * whole load or save of the disk tier, so a busy Python thread (an engine's step loop) holding
 * the GIL cannot delay each I/O's return. */
#include "tpusync/file_runs.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <string.h>
#include <unistd.h>

typedef struct {
  const tps_file_run *runs;
  const struct iovec *iovs;
  int *errs;
  int n_runs;
  int write;
  int stop_on_error;
  int next;   /* the next run to take (atomic) */
  int failed; /* set once a run failed (atomic) */
} shared_t;

/* One run, going on after short transfers; 0 or an errno value. */
static int one_run(const tps_file_run *run, const struct iovec *iovs, int write) {
  struct iovec local[TPS_FILE_RUN_MAX_IOVS];
  int count = run->iov_count;
  if (count < 0 || count > TPS_FILE_RUN_MAX_IOVS) return EINVAL;
  memcpy(local, iovs + run->first_iov, (size_t)count * sizeof(struct iovec));
  struct iovec *at = local;
  off_t offset = (off_t)run->offset;
  while (count > 0) {
    int batch = count < IOV_MAX ? count : IOV_MAX;
    ssize_t n = write ? pwritev(run->fd, at, batch, offset) : preadv(run->fd, at, batch, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (n == 0) return EIO; /* the file ended before the run, or a write made no progress */
    offset += n;
    size_t left = (size_t)n;
    while (count > 0 && left >= at->iov_len) {
      left -= at->iov_len;
      at++;
      count--;
    }
    if (left) {
      at->iov_base = (char *)at->iov_base + left;
      at->iov_len -= left;
    }
  }
  return 0;
}

static void *worker(void *arg) {
  shared_t *s = (shared_t *)arg;
  for (;;) {
    int r = __atomic_fetch_add(&s->next, 1, __ATOMIC_RELAXED);
    if (r >= s->n_runs) return NULL;
    if (s->stop_on_error && __atomic_load_n(&s->failed, __ATOMIC_RELAXED)) {
      s->errs[r] = ECANCELED;
      continue;
    }
    int err = one_run(&s->runs[r], s->iovs, s->write);
    s->errs[r] = err;
    if (err) __atomic_store_n(&s->failed, 1, __ATOMIC_RELAXED);
  }
}

int tps_file_runs(const tps_file_run *runs, int n_runs, const struct iovec *iovs, int write,
                  int threads, int stop_on_error, int *errs) {
  shared_t s = {runs, iovs, errs, n_runs, write, stop_on_error, 0, 0};
  if (n_runs <= 0) return 0;
  if (threads > n_runs) threads = n_runs;
  if (threads < 1) threads = 1;
  pthread_t ids[256];
  if (threads > 256) threads = 256;
  int started = 0;
  for (; started < threads - 1; started++) {
    /* a thread that cannot start is no error: the ones started (and this one) take its runs */
    if (pthread_create(&ids[started], NULL, worker, &s)) break;
  }
  worker(&s);
  for (int i = 0; i < started; i++) pthread_join(ids[i], NULL);
  int failed = 0;
  for (int r = 0; r < n_runs; r++) failed += errs[r] != 0;
  return failed;
}
