/* Physical limits that benchmark figures are divided by (see limits.c). */
#ifndef TPUSYNC_LIMITS_H
#define TPUSYNC_LIMITS_H

#include <stddef.h>

/* How a memory-limit thread copies its slice. */
enum tps_limit_method {
  TPS_LIMIT_MEMCPY = 0,       /* glibc memcpy of the whole slice */
  TPS_LIMIT_STREAM = 1,       /* non-temporal stores, one sequential stream */
  TPS_LIMIT_STREAM_PAGES = 2, /* non-temporal stores, four pages interleaved */
  TPS_LIMIT_STREAM_FOUR = 3,  /* non-temporal stores, four 12 KiB streams, all loaded first */
};

/* Copies src to dst (n bytes, one contiguous region each) `repeats` times on `threads`
 * threads (the caller's one of them), each thread its own contiguous slice. The threads are
 * started once and meet at a barrier before and after each repeat, so seconds[r] is one
 * repeat's wall time with no dispatch in it. Returns 0, or an errno value. */
int tps_limit_copy(char *dst, const char *src, size_t n, int threads, int method, int repeats,
                   double *seconds);

/* Whether the streaming methods exist on this CPU (x86-64: SSE2 at least). */
int tps_limit_have_streaming(void);

/* TCP over loopback: `streams` connected pairs, a sender and a receiver thread each, that first
 * move `warm_bytes` per stream untimed, then `repeats` times `bytes` per stream, all streams at
 * once, started together at a barrier; seconds[r] is from that barrier until the last receiver
 * has everything. The sender writes one touched buffer in `chunk`-byte send calls; the receiver
 * reads into one buffer, at most `chunk` bytes a call, touching nothing. sndbuf > 0 sets
 * SO_SNDBUF (0: autotuned); lowat > 0 makes each receive wait for min(lowat, what is missing)
 * bytes (SO_RCVLOWAT, as tpusync's receiver does; 0: the kernel's default of 1). sender_cpu,
 * receiver_cpu >= 0 pin every sender / receiver thread to that CPU (-1: wherever the kernel
 * puts them). Returns 0, or an errno value. */
int tps_limit_tcp(int streams, size_t bytes, size_t warm_bytes, size_t chunk, int sndbuf,
                  size_t lowat, int repeats, int sender_cpu, int receiver_cpu, double *seconds);

#endif
