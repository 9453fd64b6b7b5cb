/* File I/O of many runs of consecutive file bytes on several threads, in C with no GIL (see
 * file_runs.c): the disk tier's block reads and writes. */
#ifndef TPUSYNC_FILE_RUNS_H
#define TPUSYNC_FILE_RUNS_H

#include <stdint.h>
#include <sys/uio.h>

/* One run: iov_count buffers (iovs[first_iov ...]) read from or written to the file behind fd
 * as one contiguous range starting at offset. */
typedef struct {
  int fd;
  int32_t first_iov;
  int32_t iov_count;
  int64_t offset;
} tps_file_run;

#define TPS_FILE_RUN_MAX_IOVS 1024

/* Reads (write == 0: preadv) or writes (pwritev) every run, going on after short transfers and
 * EINTR, on `threads` threads (the caller's one of them) that each take the next run not yet
 * taken. errs[r] becomes 0, or the errno of run r (EIO: the file ended, or a write made no
 * progress; ECANCELED: skipped because another run failed and stop_on_error is set). Threads
 * that cannot be started are done without (the caller's thread always runs). Returns the number
 * of runs that failed or were skipped. */
int tps_file_runs(const tps_file_run *runs, int n_runs, const struct iovec *iovs, int write,
                  int threads, int stop_on_error, int *errs);

#endif
