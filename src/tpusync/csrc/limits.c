/* The physical limits benchmark figures are divided by: a copy of one contiguous region on
 * all cores (best of glibc memcpy and non-temporal stores), and TCP over loopback with one
 * sender and one receiver thread per stream. Each times repeats between barriers, so no thread
 * start or dispatch is in a figure. */
#define _GNU_SOURCE /* pthread_setaffinity_np */
#include "tpusync/limits.h"

#include <arpa/inet.h>
#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define TPS_LIMIT_X86 1
#endif

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int tps_limit_have_streaming(void) {
#if TPS_LIMIT_X86
  return 1;
#else
  return 0;
#endif
}

/* Threads wait at the gate until every one of them was created (go: 1) or one could not be
 * (go: -1, they return): a barrier sized for all of them would otherwise never open. */
typedef struct {
  pthread_mutex_t lock;
  pthread_cond_t changed;
  int go;
} gate;

static void gate_init(gate *g) {
  pthread_mutex_init(&g->lock, NULL);
  pthread_cond_init(&g->changed, NULL);
  g->go = 0;
}

static void gate_open(gate *g, int go) {
  pthread_mutex_lock(&g->lock);
  g->go = go;
  pthread_cond_broadcast(&g->changed);
  pthread_mutex_unlock(&g->lock);
}

static int gate_wait(gate *g) {
  pthread_mutex_lock(&g->lock);
  while (g->go == 0) pthread_cond_wait(&g->changed, &g->lock);
  int go = g->go;
  pthread_mutex_unlock(&g->lock);
  return go > 0;
}

static void gate_destroy(gate *g) {
  pthread_mutex_destroy(&g->lock);
  pthread_cond_destroy(&g->changed);
}

/* Starts n threads of fn over args[i * size]; on a failure none runs past the gate and all are
 * joined. Returns 0 or the errno value of pthread_create. */
static int start_all(pthread_t *ids, int n, void *(*fn)(void *), char *args, size_t size,
                     gate *g) {
  int started = 0, err = 0;
  for (; started < n; started++)
    if ((err = pthread_create(&ids[started], NULL, fn, args + (size_t)started * size)) != 0) break;
  gate_open(g, err ? -1 : 1);
  if (err)
    for (int t = 0; t < started; t++) pthread_join(ids[t], NULL);
  return err;
}

/* --- memory ---------------------------------------------------------------------------------- */

#if TPS_LIMIT_X86
static void stream_sse2(char *dst, const char *src, size_t n) {
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
    _mm_stream_si128((__m128i *)(dst + i), a);
    _mm_stream_si128((__m128i *)(dst + i + 16), b);
    _mm_stream_si128((__m128i *)(dst + i + 32), c);
    _mm_stream_si128((__m128i *)(dst + i + 48), d);
  }
  memcpy(dst + i, src + i, n - i);
}

__attribute__((target("avx512f"))) static void stream_avx512(char *dst, const char *src,
                                                             size_t n) {
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m512i a = _mm512_loadu_si512((const void *)(src + i));
    __m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
    _mm512_stream_si512((void *)(dst + i), a);
    _mm512_stream_si512((void *)(dst + i + 64), b);
  }
  memcpy(dst + i, src + i, n - i);
}

/* Four 4 KiB pages at a time, 128 bytes of each in turn: more lines in flight than one
 * sequential stream. */
static void stream_pages(char *dst, const char *src, size_t n, int avx512) {
  const size_t page = 4096, group = 4 * page;
  size_t i = 0;
  for (; i + group <= n; i += group) {
    for (size_t offset = 0; offset < page; offset += 128) {
      for (size_t k = 0; k < 4; k++) {
        const char *s = src + i + k * page + offset;
        _mm_prefetch(s + 256, _MM_HINT_T0);
        if (avx512)
          stream_avx512(dst + i + k * page + offset, s, 128);
        else
          stream_sse2(dst + i + k * page + offset, s, 128);
      }
    }
  }
  if (avx512)
    stream_avx512(dst + i, src + i, n - i);
  else
    stream_sse2(dst + i, src + i, n - i);
}

/* Four streams of 12 KiB, 192 bytes of each in turn, the four loaded before any is stored: the
 * access pattern of the fused copy + checksum (docs/decisions/0002) without the checksum, so
 * that no product copy of a contiguous region can beat every method here for want of it. */
#define FOUR_STREAM_BYTES 12288u

__attribute__((target("avx512f"))) static void stream_four_avx512(char *dst, const char *src,
                                                                  size_t n) {
  const size_t S = FOUR_STREAM_BYTES;
  size_t i = 0;
  for (; i + 4 * S <= n; i += 4 * S) {
    for (size_t offset = 0; offset < S; offset += 192) {
      __m512i r[4][3];
      for (size_t q = 0; q < 4; q++) {
        const char *p = src + i + q * S + offset;
        _mm_prefetch(p + 192, _MM_HINT_T0);
        _mm_prefetch(p + 256, _MM_HINT_T0);
        _mm_prefetch(p + 320, _MM_HINT_T0);
      }
      for (size_t q = 0; q < 4; q++) {
        const char *p = src + i + q * S + offset;
        r[q][0] = _mm512_loadu_si512((const void *)p);
        r[q][1] = _mm512_loadu_si512((const void *)(p + 64));
        r[q][2] = _mm512_loadu_si512((const void *)(p + 128));
      }
      for (size_t q = 0; q < 4; q++) {
        char *d = dst + i + q * S + offset;
        _mm512_stream_si512((void *)d, r[q][0]);
        _mm512_stream_si512((void *)(d + 64), r[q][1]);
        _mm512_stream_si512((void *)(d + 128), r[q][2]);
      }
    }
  }
  stream_avx512(dst + i, src + i, n - i);
}

static void stream_four(char *dst, const char *src, size_t n) {
  const size_t S = FOUR_STREAM_BYTES;
  size_t i = 0;
  for (; i + 4 * S <= n; i += 4 * S)
    for (size_t offset = 0; offset < S; offset += 192)
      for (size_t q = 0; q < 4; q++) {
        const char *p = src + i + q * S + offset;
        _mm_prefetch(p + 192, _MM_HINT_T0);
        stream_sse2(dst + i + q * S + offset, p, 192);
      }
  stream_sse2(dst + i, src + i, n - i);
}

static int have_avx512(void) { return __builtin_cpu_supports("avx512f") ? 1 : 0; }
#endif

static void copy_slice(char *dst, const char *src, size_t n, int method) {
#if TPS_LIMIT_X86
  if (method != TPS_LIMIT_MEMCPY) {
    size_t head = (size_t)(-(uintptr_t)dst) & 63u; /* stores aligned to whole lines */
    if (head > n) head = n;
    memcpy(dst, src, head);
    int avx512 = have_avx512();
    if (method == TPS_LIMIT_STREAM_PAGES)
      stream_pages(dst + head, src + head, n - head, avx512);
    else if (method == TPS_LIMIT_STREAM_FOUR && avx512)
      stream_four_avx512(dst + head, src + head, n - head);
    else if (method == TPS_LIMIT_STREAM_FOUR)
      stream_four(dst + head, src + head, n - head);
    else if (avx512)
      stream_avx512(dst + head, src + head, n - head);
    else
      stream_sse2(dst + head, src + head, n - head);
    _mm_sfence();
    return;
  }
#endif
  memcpy(dst, src, n);
}

typedef struct {
  char *dst;
  const char *src;
  size_t n;
  int method, repeats;
  pthread_barrier_t *barrier;
  gate *gate;
} copy_share;

static void *copy_worker(void *arg) {
  copy_share *s = arg;
  if (!gate_wait(s->gate)) return NULL;
  for (int r = 0; r < s->repeats; r++) {
    pthread_barrier_wait(s->barrier);
    copy_slice(s->dst, s->src, s->n, s->method);
    pthread_barrier_wait(s->barrier);
  }
  return NULL;
}

int tps_limit_copy(char *dst, const char *src, size_t n, int threads, int method, int repeats,
                   double *seconds) {
  if (threads < 1 || repeats < 1 || method < 0 || method > 3) return EINVAL;
  copy_share *shares = calloc((size_t)threads, sizeof *shares);
  pthread_t *ids = calloc((size_t)threads, sizeof *ids);
  pthread_barrier_t barrier;
  if (!shares || !ids || pthread_barrier_init(&barrier, NULL, (unsigned)threads) != 0) {
    free(shares);
    free(ids);
    return ENOMEM;
  }
  gate g;
  gate_init(&g);
  size_t start = 0;
  for (int t = 0; t < threads; t++) { /* 4 KiB-aligned slice bounds */
    size_t end = t == threads - 1 ? n : (n / (size_t)threads * (size_t)(t + 1)) & ~(size_t)4095;
    if (end < start) end = start;
    shares[t] = (copy_share){dst + start, src + start, end - start, method, repeats, &barrier, &g};
    start = end;
  }
  int err = start_all(ids + 1, threads - 1, copy_worker, (char *)(shares + 1), sizeof *shares, &g);
  if (err) {
    gate_destroy(&g);
    pthread_barrier_destroy(&barrier);
    free(shares);
    free(ids);
    return err;
  }
  for (int r = 0; r < repeats; r++) {
    pthread_barrier_wait(&barrier);
    double t0 = now_s();
    copy_slice(shares[0].dst, shares[0].src, shares[0].n, method);
    pthread_barrier_wait(&barrier);
    seconds[r] = now_s() - t0;
  }
  for (int t = 1; t < threads; t++) pthread_join(ids[t], NULL);
  gate_destroy(&g);
  pthread_barrier_destroy(&barrier);
  free(shares);
  free(ids);
  return 0;
}

/* --- TCP over loopback ----------------------------------------------------------------------- */

typedef struct {
  int fd;
  size_t bytes, warm_bytes, chunk, lowat;
  int repeats, sender, cpu;
  char *buffer;
  pthread_barrier_t *start, *done;
  gate *gate;
  int err;
} tcp_end;

static int send_all(int fd, const char *buffer, size_t chunk, size_t bytes) {
  while (bytes) {
    size_t n = bytes < chunk ? bytes : chunk;
    ssize_t k = send(fd, buffer, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    bytes -= (size_t)k;
  }
  return 0;
}

/* lowat > 0: tpusync's receive loop -- read without waiting while data is there; when nothing
 * is, wait in poll() until min(lowat, what is still missing) bytes arrived (SO_RCVLOWAT: one
 * wake-up per lowat bytes, not per packet), or 50 ms passed (the window may hold less than the
 * mark), then read again. lowat == 0: plain blocking reads. */
static int recv_all(int fd, char *buffer, size_t chunk, size_t lowat, size_t bytes) {
  int mark = 1;
  struct pollfd pfd = {.fd = fd, .events = POLLIN};
  while (bytes) {
    size_t n = bytes < chunk ? bytes : chunk;
    ssize_t k = recv(fd, buffer, n, lowat ? MSG_DONTWAIT : 0);
    if (k < 0) {
      if (errno == EINTR) continue;
      if (lowat && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        size_t want = bytes < lowat ? bytes : lowat;
        int w = want > INT_MAX ? INT_MAX : (int)want;
        if (w != mark && setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &w, sizeof w) == 0) mark = w;
        if (poll(&pfd, 1, 50) < 0 && errno != EINTR) return errno;
        continue;
      }
      return errno;
    }
    if (k == 0) return ECONNRESET;
    bytes -= (size_t)k;
  }
  return 0;
}

static void *tcp_worker(void *arg) {
  tcp_end *e = arg;
  if (!gate_wait(e->gate)) return NULL;
  int err = 0;
  if (e->cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(e->cpu, &set);
    err = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  }
  if (!err)
    err = e->sender ? send_all(e->fd, e->buffer, e->chunk, e->warm_bytes)
                      : recv_all(e->fd, e->buffer, e->chunk, e->lowat, e->warm_bytes);
  if (err) shutdown(e->fd, SHUT_RDWR);
  for (int r = 0; r < e->repeats; r++) {
    pthread_barrier_wait(e->start);
    if (!err) {
      err = e->sender ? send_all(e->fd, e->buffer, e->chunk, e->bytes)
                      : recv_all(e->fd, e->buffer, e->chunk, e->lowat, e->bytes);
      if (err) shutdown(e->fd, SHUT_RDWR); /* the other end stops waiting too */
    }
    pthread_barrier_wait(e->done);
  }
  e->err = err;
  return NULL;
}

/* A connected pair over 127.0.0.1 through a listener on a free port. */
static int tcp_pair(int listener, const struct sockaddr_in *at, int sndbuf, int fds[2]) {
  int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (c < 0) return errno;
  int one = 1;
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (sndbuf > 0) setsockopt(c, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
  if (connect(c, (const struct sockaddr *)at, sizeof *at) != 0) {
    int err = errno;
    close(c);
    return err;
  }
  int s = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
  if (s < 0) {
    int err = errno;
    close(c);
    return err;
  }
  fds[0] = c; /* sends */
  fds[1] = s; /* receives */
  return 0;
}

int tps_limit_tcp(int streams, size_t bytes, size_t warm_bytes, size_t chunk, int sndbuf,
                  size_t lowat, int repeats, int sender_cpu, int receiver_cpu, double *seconds) {
  if (streams < 1 || repeats < 1 || chunk < 1 || bytes < 1) return EINVAL;
  if (sender_cpu >= CPU_SETSIZE || receiver_cpu >= CPU_SETSIZE) return EINVAL;
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) return errno;
  struct sockaddr_in at = {.sin_family = AF_INET, .sin_port = 0};
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof at;
  int err = 0;
  if (bind(listener, (struct sockaddr *)&at, sizeof at) != 0 || listen(listener, streams) != 0 ||
      getsockname(listener, (struct sockaddr *)&at, &len) != 0) {
    err = errno;
    close(listener);
    return err;
  }
  int n_ends = 2 * streams;
  tcp_end *ends = calloc((size_t)n_ends, sizeof *ends);
  pthread_t *ids = calloc((size_t)n_ends, sizeof *ids);
  char *buffers = malloc((size_t)n_ends * chunk);
  pthread_barrier_t start, done;
  gate g;
  gate_init(&g);
  if (!ends || !ids || !buffers) err = ENOMEM;
  for (int i = 0; ends && i < n_ends; i++) ends[i].fd = -1;
  for (int p = 0; !err && p < streams; p++) {
    int fds[2];
    err = tcp_pair(listener, &at, sndbuf, fds);
    if (err) break;
    for (int side = 0; side < 2; side++) {
      tcp_end *e = &ends[2 * p + side];
      *e = (tcp_end){fds[side], bytes, warm_bytes, chunk, lowat, repeats, side == 0,
                     side == 0 ? sender_cpu : receiver_cpu, buffers + (size_t)(2 * p + side) * chunk, &start, &done, &g, 0};
    }
  }
  close(listener);
  if (!err) {
    memset(buffers, 0x5a, (size_t)n_ends * chunk); /* touched: no page faults while timed */
    pthread_barrier_init(&start, NULL, (unsigned)n_ends + 1);
    pthread_barrier_init(&done, NULL, (unsigned)n_ends + 1);
    err = start_all(ids, n_ends, tcp_worker, (char *)ends, sizeof *ends, &g);
    if (!err) {
      for (int r = 0; r < repeats; r++) {
        pthread_barrier_wait(&start);
        double t0 = now_s();
        pthread_barrier_wait(&done);
        seconds[r] = now_s() - t0;
      }
      for (int t = 0; t < n_ends; t++) pthread_join(ids[t], NULL);
      for (int i = 0; i < n_ends && !err; i++) err = ends[i].err;
    }
    pthread_barrier_destroy(&start);
    pthread_barrier_destroy(&done);
  }
  for (int i = 0; ends && i < n_ends; i++)
    if (ends[i].fd >= 0) close(ends[i].fd);
  gate_destroy(&g);
  free(ends);
  free(ids);
  free(buffers);
  return err;
}
