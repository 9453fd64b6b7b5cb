/* XXH64, implemented from the algorithm's public description (see checksum.h). */
#include "tpusync/checksum.h"

#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

static const uint64_t K1 = 0x9E3779B185EBCA87ULL;
static const uint64_t K2 = 0xC2B2AE3D27D4EB4FULL;
static const uint64_t K3 = 0x165667B19E3779F9ULL;
static const uint64_t K4 = 0x85EBCA77C2B2AE63ULL;
static const uint64_t K5 = 0x27D4EB2F165667C5ULL;

static inline uint64_t rotate_left(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t load64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8); /* little-endian hosts only (x86-64, aarch64) */
  return v;
}

static inline uint32_t load32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}

static inline uint64_t mix_lane(uint64_t lane, uint64_t input) {
  lane += input * K2;
  lane = rotate_left(lane, 31);
  return lane * K1;
}

static inline uint64_t fold_lane(uint64_t hash, uint64_t lane) {
  hash ^= mix_lane(0, lane);
  return hash * K1 + K4;
}

/* Consumes whole 32-byte stripes; returns the bytes consumed. */
static size_t consume_stripes(uint64_t lanes[4], const uint8_t *p, size_t n) {
  uint64_t a = lanes[0], b = lanes[1], c = lanes[2], d = lanes[3];
  size_t done = 0;
  for (; done + 32 <= n; done += 32) {
    a = mix_lane(a, load64(p + done));
    b = mix_lane(b, load64(p + done + 8));
    c = mix_lane(c, load64(p + done + 16));
    d = mix_lane(d, load64(p + done + 24));
  }
  lanes[0] = a;
  lanes[1] = b;
  lanes[2] = c;
  lanes[3] = d;
  return done;
}

void tps_xxh64_init(tps_xxh64_state *s, uint64_t seed) {
  s->lanes[0] = seed + K1 + K2;
  s->lanes[1] = seed + K2;
  s->lanes[2] = seed;
  s->lanes[3] = seed - K1;
  s->seed = seed;
  s->total = 0;
  s->n_pending = 0;
}

void tps_xxh64_update(tps_xxh64_state *s, const void *data, size_t n) {
  const uint8_t *p = data;
  s->total += n;
  if (s->n_pending) {
    size_t take = 32 - s->n_pending;
    if (take > n) take = n;
    memcpy(s->pending + s->n_pending, p, take);
    s->n_pending += (uint32_t)take;
    p += take;
    n -= take;
    if (s->n_pending < 32) return;
    consume_stripes(s->lanes, s->pending, 32);
    s->n_pending = 0;
  }
  size_t done = consume_stripes(s->lanes, p, n);
  memcpy(s->pending, p + done, n - done);
  s->n_pending = (uint32_t)(n - done);
}

uint64_t tps_xxh64_digest(const tps_xxh64_state *s) {
  uint64_t h;
  if (s->total >= 32) {
    const uint64_t *v = s->lanes;
    h = rotate_left(v[0], 1) + rotate_left(v[1], 7) + rotate_left(v[2], 12) +
        rotate_left(v[3], 18);
    h = fold_lane(h, v[0]);
    h = fold_lane(h, v[1]);
    h = fold_lane(h, v[2]);
    h = fold_lane(h, v[3]);
  } else {
    h = s->seed + K5;
  }
  h += s->total;
  const uint8_t *p = s->pending;
  size_t n = s->n_pending;
  for (; n >= 8; p += 8, n -= 8) {
    h ^= mix_lane(0, load64(p));
    h = rotate_left(h, 27) * K1 + K4;
  }
  if (n >= 4) {
    h ^= (uint64_t)load32(p) * K1;
    h = rotate_left(h, 23) * K2 + K3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; p++, n--) {
    h ^= (uint64_t)(*p) * K5;
    h = rotate_left(h, 11) * K1;
  }
  h ^= h >> 33;
  h *= K2;
  h ^= h >> 29;
  h *= K3;
  h ^= h >> 32;
  return h;
}

uint64_t tps_xxh64(const void *data, size_t n, uint64_t seed) {
  tps_xxh64_state s;
  tps_xxh64_init(&s, seed);
  tps_xxh64_update(&s, data, n);
  return tps_xxh64_digest(&s);
}

/* --- CRC-32C and the three-lane piece checksum -------------------------------------------- */

#define CRC32C_POLY 0x82F63B78u /* reflected Castagnoli polynomial */

static uint32_t crc_table[8][256];
static int crc_table_ready;
static int force_portable;

static void build_crc_table(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ CRC32C_POLY : c >> 1;
    crc_table[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; i++)
    for (int t = 1; t < 8; t++)
      crc_table[t][i] = (crc_table[t - 1][i] >> 8) ^ crc_table[0][crc_table[t - 1][i] & 0xFF];
  __atomic_store_n(&crc_table_ready, 1, __ATOMIC_RELEASE);
}

static inline void ensure_table(void) {
  if (!__atomic_load_n(&crc_table_ready, __ATOMIC_ACQUIRE)) build_crc_table(); /* idempotent */
}

/* Raw (no pre/post inversion) CRC steps. */
static inline uint32_t crc_byte_portable(uint32_t c, uint8_t b) {
  return (c >> 8) ^ crc_table[0][(c ^ b) & 0xFF];
}

static inline uint32_t crc_word_portable(uint32_t c, uint64_t w) {
  w ^= c;
  return crc_table[7][w & 0xFF] ^ crc_table[6][(w >> 8) & 0xFF] ^ crc_table[5][(w >> 16) & 0xFF] ^
         crc_table[4][(w >> 24) & 0xFF] ^ crc_table[3][(w >> 32) & 0xFF] ^
         crc_table[2][(w >> 40) & 0xFF] ^ crc_table[1][(w >> 48) & 0xFF] ^
         crc_table[0][(w >> 56) & 0xFF];
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) static inline uint32_t crc_word_hw(uint32_t c, uint64_t w) {
  return (uint32_t)__builtin_ia32_crc32di(c, w);
}
__attribute__((target("sse4.2"))) static inline uint32_t crc_byte_hw(uint32_t c, uint8_t b) {
  return __builtin_ia32_crc32qi(c, b);
}
/* Three lanes over n_groups groups of three words, with the CPU's CRC instruction. */
__attribute__((target("sse4.2"))) static void lanes_hw(uint32_t lanes[3], const uint8_t *p,
                                                       size_t n_groups) {
  uint64_t a = lanes[0], b = lanes[1], c = lanes[2];
  for (size_t i = 0; i < n_groups; i++, p += 24) {
    if (i % 8 == 0) { /* 192 bytes: three lines, fetched 4 KiB ahead as in copy_crc_blocks */
      _mm_prefetch((const char *)p + 4096, _MM_HINT_T0);
      _mm_prefetch((const char *)p + 4096 + 64, _MM_HINT_T0);
      _mm_prefetch((const char *)p + 4096 + 128, _MM_HINT_T0);
    }
    a = __builtin_ia32_crc32di(a, load64(p));
    b = __builtin_ia32_crc32di(b, load64(p + 8));
    c = __builtin_ia32_crc32di(c, load64(p + 16));
  }
  lanes[0] = (uint32_t)a;
  lanes[1] = (uint32_t)b;
  lanes[2] = (uint32_t)c;
}
static int have_sse42(void) {
  static int cached = -1;
  if (cached < 0) cached = __builtin_cpu_supports("sse4.2") ? 1 : 0;
  return cached && !force_portable;
}
#else
static int have_sse42(void) { return 0; }
#endif

static void lanes_portable(uint32_t lanes[3], const uint8_t *p, size_t n_groups) {
  ensure_table();
  for (size_t i = 0; i < n_groups; i++, p += 24) {
    lanes[0] = crc_word_portable(lanes[0], load64(p));
    lanes[1] = crc_word_portable(lanes[1], load64(p + 8));
    lanes[2] = crc_word_portable(lanes[2], load64(p + 16));
  }
}

static void feed_groups(uint32_t lanes[3], const uint8_t *p, size_t n_groups) {
#if defined(__x86_64__)
  if (have_sse42()) {
    lanes_hw(lanes, p, n_groups);
    return;
  }
#endif
  lanes_portable(lanes, p, n_groups);
}

static uint32_t feed_word(uint32_t c, uint64_t w) {
#if defined(__x86_64__)
  if (have_sse42()) return crc_word_hw(c, w);
#endif
  ensure_table();
  return crc_word_portable(c, w);
}

static uint32_t feed_byte(uint32_t c, uint8_t b) {
#if defined(__x86_64__)
  if (have_sse42()) return crc_byte_hw(c, b);
#endif
  ensure_table();
  return crc_byte_portable(c, b);
}

void tps_checksum_force_portable(int on) { force_portable = on; }

uint32_t tps_crc32c(uint32_t crc, const void *data, size_t n) {
  const uint8_t *p = data;
  uint32_t c = ~crc;
  for (; n >= 8; p += 8, n -= 8) c = feed_word(c, load64(p));
  for (; n > 0; p++, n--) c = feed_byte(c, *p);
  return ~c;
}

/* --- Shifting a CRC over zero bytes, to join CRCs of pieces computed apart ------------------
 * A raw CRC is linear: crc(c, A || B) = crc(c, zeros(|B|)) ^ crc(0, B), and feeding m zero
 * bytes multiplies c by x^(8m) modulo the polynomial. So a lane split in pieces, each piece
 * run from 0 except the first, joins into exactly the value one pass would give. */

/* a * b modulo the polynomial, reflected (bit 31 holds x^0). */
static uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t p = 0;
  for (int i = 0; i < 32; i++) { /* b runs through b * x^i */
    if (a & (0x80000000u >> i)) p ^= b;
    b = b & 1 ? (b >> 1) ^ CRC32C_POLY : b >> 1;
  }
  return p;
}

/* x_pow[k] = x^(8 * 2^k) and x_pow_33[k] = x^(8 * 2^k - 33) mod P, for k >= 3 (64+ bits). */
static uint32_t x_pow[64], x_pow_33[64];
static int x_pow_ready;

static void build_x_pow(void) {
  x_pow[0] = 0x80000000u >> 8; /* x^8 */
  for (int k = 1; k < 64; k++) x_pow[k] = multmodp(x_pow[k - 1], x_pow[k - 1]);
  x_pow_33[3] = 0x80000000u >> 31; /* x^(64 - 33) */
  for (int k = 4; k < 64; k++) x_pow_33[k] = multmodp(x_pow_33[k - 1], x_pow[k - 1]);
  __atomic_store_n(&x_pow_ready, 1, __ATOMIC_RELEASE);
}

#if defined(__x86_64__)
/* c * x^(8 * 2^k) for k >= 3: the carry-less product with x^(8 * 2^k - 33) is a 63-bit value
 * that the crc32 instruction reduces while multiplying by x^32, and the reflected layout adds
 * one more x: 33 in all. Checked against the portable code by the tests. */
__attribute__((target("sse4.2,pclmul"))) static uint32_t shift_pow_hw(uint32_t c, int k) {
  __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)c),
                                         _mm_cvtsi32_si128((int)x_pow_33[k]), 0);
  return (uint32_t)__builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(product));
}
static int have_pclmul(void) {
  static int cached = -1;
  if (cached < 0) cached = __builtin_cpu_supports("pclmul") ? 1 : 0;
  return cached && have_sse42();
}
#else
static int have_pclmul(void) { return 0; }
#endif

uint32_t tps_crc32c_shift(uint32_t c, uint64_t m) {
  if (!__atomic_load_n(&x_pow_ready, __ATOMIC_ACQUIRE)) build_x_pow(); /* idempotent */
  for (; m & 7; m--) c = feed_byte(c, 0);
  int hw = have_pclmul();
  (void)hw; /* no instruction path off x86 */
  for (int k = 3; k < 64 && m >> k; k++) {
    if (!((m >> k) & 1)) continue;
#if defined(__x86_64__)
    if (hw) {
      c = shift_pow_hw(c, k);
      continue;
    }
#endif
    c = multmodp(c, x_pow[k]);
  }
  return c;
}

void tps_sum64_init(tps_sum64_state *s) {
  s->lanes[0] = s->lanes[1] = s->lanes[2] = 0xFFFFFFFFu;
  s->total = 0;
  s->n_pending = 0;
}

void tps_sum64_update(tps_sum64_state *s, const void *data, size_t n) {
  const uint8_t *p = data;
  s->total += n;
  if (s->n_pending) {
    size_t take = 24 - s->n_pending;
    if (take > n) take = n;
    memcpy(s->pending + s->n_pending, p, take);
    s->n_pending += (uint32_t)take;
    p += take;
    n -= take;
    if (s->n_pending < 24) return;
    feed_groups(s->lanes, s->pending, 1);
    s->n_pending = 0;
  }
  size_t groups = n / 24;
  feed_groups(s->lanes, p, groups);
  memcpy(s->pending, p + groups * 24, n - groups * 24);
  s->n_pending = (uint32_t)(n - groups * 24);
}

uint64_t tps_sum64_digest(const tps_sum64_state *s) {
  uint32_t lanes[3] = {s->lanes[0], s->lanes[1], s->lanes[2]};
  const uint8_t *p = s->pending;
  size_t n = s->n_pending;
  for (int lane = 0; n >= 8; lane++, p += 8, n -= 8) lanes[lane] = feed_word(lanes[lane], load64(p));
  for (; n > 0; p++, n--) lanes[0] = feed_byte(lanes[0], *p);
  /* Mix: lanes 0 and 1 fill 64 bits, lane 2 and the length are folded in, then the 64-bit
   * finalizer of MurmurHash3 spreads every input bit over the result. */
  uint64_t h = ((uint64_t)~lanes[1] << 32) | (uint64_t)~lanes[0];
  h ^= rotate_left(((uint64_t)~lanes[2] << 32 | (uint64_t)~lanes[2]) * K1, 29);
  h ^= s->total * K2;
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDULL;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ULL;
  h ^= h >> 33;
  return h;
}

uint64_t tps_sum64(const void *data, size_t n) {
  tps_sum64_state s;
  tps_sum64_init(&s);
  tps_sum64_update(&s, data, n);
  return tps_sum64_digest(&s);
}

#if defined(__x86_64__)
/* 192 bytes per step: 12 streamed 16-byte stores, and 8 words for each of the three lanes. */
#define PREFETCH_AHEAD 4096
__attribute__((target("sse4.2"))) static void copy_crc_blocks(uint32_t lanes[3], char *dst,
                                                              const char *src, size_t blocks,
                                                              const char *end, const char *next) {
  uint64_t a = lanes[0], b = lanes[1], c = lanes[2];
  for (size_t i = 0; i < blocks; i++, src += 192, dst += 192) {
    /* Reads run 4 KiB ahead: one sequential stream is latency-bound without it (measured
     * here: 0.63x a streaming copy fused, 0.81x with it). Near the end of the piece, they run
     * into the next piece the caller reads instead (harmless when it is NULL or short). */
    const char *ahead = src + PREFETCH_AHEAD;
    if (ahead >= end && next) ahead = next + (ahead - end);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    for (int w = 0; w < 192; w += 24) { /* checksum first: its loads bring the lines in */
      a = __builtin_ia32_crc32di(a, load64((const uint8_t *)src + w));
      b = __builtin_ia32_crc32di(b, load64((const uint8_t *)src + w + 8));
      c = __builtin_ia32_crc32di(c, load64((const uint8_t *)src + w + 16));
    }
    for (int k = 0; k < 192; k += 16)
      _mm_stream_si128((__m128i *)(dst + k), _mm_loadu_si128((const __m128i *)(src + k)));
  }
  lanes[0] = (uint32_t)a;
  lanes[1] = (uint32_t)b;
  lanes[2] = (uint32_t)c;
}
#endif

int tps_sum64_copy_streaming(tps_sum64_state *s, void *dst, const void *src, size_t n) {
  return tps_sum64_copy_streaming_next(s, dst, src, n, NULL);
}

int tps_sum64_copy_streaming_next(tps_sum64_state *s, void *dst, const void *src, size_t n,
                                  const void *next) {
#if defined(__x86_64__)
  if (!have_sse42() || s->n_pending != 0) return 0;
  /* Find a head length h that aligns dst to 16 and keeps the checksum at a group boundary
   * (h a multiple of 24): h = 0 or 24 when dst is 8-byte aligned. */
  uintptr_t d = (uintptr_t)dst;
  size_t head;
  if (d % 16 == 0)
    head = 0;
  else if (d % 16 == 8)
    head = 24;
  else
    return 0;
  if (head > n) head = n;
  const char *sp = src;
  char *dp = dst;
  tps_sum64_update(s, sp, head);
  memcpy(dp, sp, head);
  sp += head;
  dp += head;
  n -= head;
  size_t blocks = n / 192;
  copy_crc_blocks(s->lanes, dp, sp, blocks, (const char *)src + head + n, next);
  s->total += blocks * 192;
  sp += blocks * 192;
  dp += blocks * 192;
  n -= blocks * 192;
  tps_sum64_update(s, sp, n);
  memcpy(dp, sp, n);
  return 1;
#else
  (void)s, (void)dst, (void)src, (void)n, (void)next;
  return 0;
#endif
}
