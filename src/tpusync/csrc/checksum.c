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
/* Tops up a streaming state's partial unit (a stripe or a group of `unit` bytes) from the
 * input, advancing *p and *n past what it took; returns whether the unit is now whole. */
static inline int fill_pending(uint8_t *pending, uint32_t *n_pending, size_t unit,
                               const uint8_t **p, size_t *n) {
  size_t take = unit - *n_pending;
  if (take > *n) take = *n;
  memcpy(pending + *n_pending, *p, take);
  *n_pending += (uint32_t)take;
  *p += take;
  *n -= take;
  return *n_pending == unit;
}

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
    if (!fill_pending(s->pending, &s->n_pending, 32, &p, &n)) return;
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
/* The forced code path (tps_checksum_force_portable). Each extension module links its own copy
 * of this file; they all read the checksum module's flag (tps_checksum_share_path_flag). */
static int own_path_flag;
static int *force_portable = &own_path_flag;

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
  return cached && *force_portable != 1;
}
#else
static int have_sse42(void) { return 0; }
#endif

/* The head of a fused copy before its 192-byte blocks: h bytes, whole 24-byte groups of the
 * checksum, that align dst to a cache line, so that non-temporal stores write whole lines at
 * once (a line written in parts costs about a third of the rate). h = 24 t with 24 t = -dst
 * (mod 64) exists for any 8-byte aligned dst: t = 3 (-dst / 8) mod 8, since 3 * 3 = 1 (mod 8). */
#if defined(__x86_64__)
static size_t line_head(const void *dst, size_t n) {
  size_t head = 24 * ((3 * ((64 - (uintptr_t)dst % 64) / 8)) % 8);
  return head < n ? head : n;
}

/* --- The three lanes by carry-less multiplication (AVX-512 with VPCLMULQDQ) -------------------
 * The same lane values as the crc32 instruction, computed the way fast CRC code folds long
 * messages: crc32 runs one word per cycle through a chain of dependent steps, which a copy
 * that waits on memory keeps stalling; multiplications fold many words at once, so the fused
 * copy below runs at the rate of a copy (docs/decisions/0002).
 *
 * Polynomials are bit-reflected as the CRC is: bit j of a 32-bit value is the coefficient of
 * x^(31-j), bit t of a 64-bit word that of x^(63-t), bit t of a 128-bit value that of
 * x^(127-t). With U the word fed and C the lane, crc32q(C, U) = (U + C x^32) x^32 mod P, so a
 * lane over words U_0..U_(m-1) from C ends at x^32 (U'_0 x^(64(m-1)) + ... + U_(m-1)) mod P,
 * U'_0 = U_0 + C x^32. Lane l reads the words at l, l+3, l+6, ... of each 192-byte block (24
 * words, eight per lane); the block's words (l + 6t, l + 6t + 3) are lane words 2t and 2t+1, a
 * 128-bit slot worth U_2t x^64 + U_2t+1, whose place in the lane is x^(128(3-t)) within the
 * block and x^512 further per later block. Three 512-bit accumulators hold the twelve slots;
 * each block multiplies them by x^512 ("folds": each 64-bit half times a 32-bit constant, see
 * clm_block) and adds the block's slots. Only the sum modulo P matters, so a fold may leave any
 * value of the same residue. At the end each slot is folded by x^(128(3-t)), the four slots of
 * a lane are added, and two crc32 steps reduce the 128 bits: crc32q(crc32q(0, lo), hi) is
 * x^32 (lo x^64 + hi) mod P. The tests check all of it against crc32 and the tables.
 *
 * A carry-less product of a 64-bit word (x^(63-t) at bit t) and a 32-bit constant K (x^(31-j)
 * at bit j), read as a 128-bit value, is word * K * x^33: folding a word by x^e takes the
 * constant x^(e-33) mod P. The constants below are such powers (reflected, computed with
 * multmodp). */
#define CLM_TARGET __attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.2")))

/* Folding by x^512, in each 128-bit slot: the low word (x^64 further) by x^543, the high by
 * x^479. */
static const uint64_t clm_fold512[8] = {0x740eef02, 0x9e4addf8, 0x740eef02, 0x9e4addf8,
                                         0x740eef02, 0x9e4addf8, 0x740eef02, 0x9e4addf8};
/* The final fold of each accumulator's slots by x^(128(3-t)): (x^(D+31), x^(D-33)) for D =
 * 384, 256, 128; zero for the t = 3 slots, which are added unfolded (see clm_finish). */
#define CLM_F384 0x1c291d04, 0xddc0152b
#define CLM_F256 0x3da6d0cb, 0xba4fc28e
#define CLM_F128 0xf20c0dfe, 0x493c7d27
static const uint64_t clm_final_fold[3][8] = {
    {CLM_F384, CLM_F384, CLM_F384, CLM_F256},
    {CLM_F256, CLM_F256, CLM_F128, CLM_F128},
    {CLM_F128, 0, 0, 0, 0, 0, 0},
};
/* x^-449 mod P: a lane's starting value C enters as C x^96 in its first slot, before that
 * slot's first fold by x^512; C x^-416 folds into it. */
#define CLM_X_MINUS_449 0x81bc720fu

/* The block's 24 words into the three accumulators' slots (word indices; 8+ = second source):
 * a0 = (0,3) (1,4) (2,5) (6,9), a1 = (7,10) (8,11) (12,15) (13,16), a2 = (14,17) (18,21)
 * (19,22) (20,23), i.e. lane/t: a0 = 0/0 1/0 2/0 0/1, a1 = 1/1 2/1 0/2 1/2, a2 = 2/2 0/3 1/3
 * 2/3. */
static const uint64_t clm_pick0[8] = {0, 3, 1, 4, 2, 5, 6, 9};         /* of block words 0-15 */
static const uint64_t clm_pick1a[8] = {7, 10, 8, 11, 12, 15, 13, 0};   /* of words 0-15 */
static const uint64_t clm_pick1b[8] = {0, 1, 2, 3, 4, 5, 6, 8};        /* then word 16 */
static const uint64_t clm_pick2[8] = {6, 9, 10, 13, 11, 14, 12, 15};   /* of words 8-23 */

/* Four streams (below) over 4 S bytes, S in 12, 6, 3 or 1.5 KiB: stream q is folded by
 * x^(8 (3 - q) S / 3) into the sum, i.e. (x^(D+31), x^(D-33)) for D = 8 (3 - q) S / 3. */
#define CLM_N_STREAMS 4
static const size_t clm_stream_bytes[4] = {12288, 6144, 3072, 1536};
static const uint32_t clm_stream_fold[4][3][2] = {
    {{0xe1e5a161, 0xc1f19ee1}, {0xe040e0ac, 0x54a86326}, {0xc2a5b65e, 0x82f89c77}},
    {{0xdb808623, 0xb9d68d49}, {0xc2a5b65e, 0x82f89c77}, {0xf7506984, 0xa51b6135}},
    {{0xdada9a0b, 0x359674f7}, {0xf7506984, 0xa51b6135}, {0xfe314258, 0x170076fa}},
    {{0x1dfa0a15, 0x9ef68d35}, {0xfe314258, 0x170076fa}, {0xbd6f81f8, 0xdd7e3b0c}},
};

typedef struct clm_ctx {
  __m512i fold, pick0, pick1a, pick1b, pick2;
} clm_ctx;

CLM_TARGET static inline clm_ctx clm_context(void) {
  clm_ctx k;
  k.fold = _mm512_loadu_si512(clm_fold512);
  k.pick0 = _mm512_loadu_si512(clm_pick0);
  k.pick1a = _mm512_loadu_si512(clm_pick1a);
  k.pick1b = _mm512_loadu_si512(clm_pick1b);
  k.pick2 = _mm512_loadu_si512(clm_pick2);
  return k;
}

/* acc * x^D mod P (as some value of that residue), with k = (x^(D+31), x^(D-33)) per slot. */
CLM_TARGET static inline __m512i clm_mul(__m512i acc, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(acc, k, 0x00),
                          _mm512_clmulepi64_epi128(acc, k, 0x11));
}

/* Folds one block (three 64-byte vectors, in order) into the accumulators. */
CLM_TARGET static inline void clm_block(const clm_ctx *k, __m512i a[3], __m512i r0, __m512i r1,
                                        __m512i r2) {
  __m512i d0 = _mm512_permutex2var_epi64(r0, k->pick0, r1);
  __m512i d1 = _mm512_permutex2var_epi64(_mm512_permutex2var_epi64(r0, k->pick1a, r1),
                                         k->pick1b, r2);
  __m512i d2 = _mm512_permutex2var_epi64(r1, k->pick2, r2);
  a[0] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a[0], k->fold, 0x00),
                                   _mm512_clmulepi64_epi128(a[0], k->fold, 0x11), d0, 0x96);
  a[1] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a[1], k->fold, 0x00),
                                   _mm512_clmulepi64_epi128(a[1], k->fold, 0x11), d1, 0x96);
  a[2] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(a[2], k->fold, 0x00),
                                   _mm512_clmulepi64_epi128(a[2], k->fold, 0x11), d2, 0x96);
}

/* The high half of the t = 0 slot that continues a lane's value (see CLM_X_MINUS_449). */
__attribute__((target("pclmul,sse4.2"))) static inline uint64_t clm_entry(uint32_t lane) {
  __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)lane),
                                         _mm_cvtsi32_si128((int)CLM_X_MINUS_449), 0);
  uint64_t c = (uint32_t)__builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(product));
  return c << 32; /* degree < 32: the low end of the slot */
}

/* Accumulators that continue the lanes' values. */
CLM_TARGET static void clm_start(__m512i a[3], const uint32_t lanes[3]) {
  uint64_t slots[8] = {0};
  for (int l = 0; l < 3; l++) slots[2 * l + 1] = clm_entry(lanes[l]);
  a[0] = _mm512_loadu_si512(slots);
  a[1] = _mm512_setzero_si512();
  a[2] = _mm512_setzero_si512();
}

/* The lanes' values from the accumulators. */
CLM_TARGET static void clm_finish(uint32_t lanes[3], const __m512i a[3]) {
  uint64_t q[3][8];
  for (int i = 0; i < 3; i++)
    _mm512_storeu_si512(q[i], clm_mul(a[i], _mm512_loadu_si512(clm_final_fold[i])));
  uint64_t raw[8]; /* the t = 3 slots of a[2] (1-3), unfolded */
  _mm512_storeu_si512(raw, a[2]);
  uint64_t lo[3], hi[3];
  lo[0] = q[0][0] ^ q[0][6] ^ q[1][4] ^ raw[2];
  hi[0] = q[0][1] ^ q[0][7] ^ q[1][5] ^ raw[3];
  lo[1] = q[0][2] ^ q[1][0] ^ q[1][6] ^ raw[4];
  hi[1] = q[0][3] ^ q[1][1] ^ q[1][7] ^ raw[5];
  lo[2] = q[0][4] ^ q[1][2] ^ q[2][0] ^ raw[6];
  hi[2] = q[0][5] ^ q[1][3] ^ q[2][1] ^ raw[7];
  for (int l = 0; l < 3; l++)
    lanes[l] = (uint32_t)__builtin_ia32_crc32di(__builtin_ia32_crc32di(0, lo[l]), hi[l]);
}

CLM_TARGET static inline void clm_store(char *dst, __m512i r0, __m512i r1, __m512i r2) {
  _mm512_stream_si512((void *)dst, r0);
  _mm512_stream_si512((void *)(dst + 64), r1);
  _mm512_stream_si512((void *)(dst + 128), r2);
}

/* 4 S bytes as four streams of S, 192 bytes of each in turn: like a streaming copy of four
 * pages at once, more lines are in flight than with one stream (docs/decisions/0002). Each
 * stream folds into its own accumulators (the first continues a), joined at the end. With dst,
 * the bytes are also copied there with non-temporal stores (dst 64-byte aligned). */
CLM_TARGET static inline void clm_streams(const clm_ctx *k, __m512i a[3], char *dst,
                                          const char *src, size_t S, int which) {
  __m512i acc[CLM_N_STREAMS][3];
  for (int i = 0; i < 3; i++) acc[0][i] = a[i];
  for (int q = 1; q < CLM_N_STREAMS; q++)
    for (int i = 0; i < 3; i++) acc[q][i] = _mm512_setzero_si512();
  for (size_t offset = 0; offset < S; offset += 192) {
    __m512i r[CLM_N_STREAMS][3];
    for (int q = 0; q < CLM_N_STREAMS; q++) {
      const char *p = src + q * S + offset;
      _mm_prefetch(p + 192, _MM_HINT_T0);
      _mm_prefetch(p + 256, _MM_HINT_T0);
      _mm_prefetch(p + 320, _MM_HINT_T0);
    }
    for (int q = 0; q < CLM_N_STREAMS; q++) { /* loads first: all four streams in flight */
      const char *p = src + q * S + offset;
      r[q][0] = _mm512_loadu_si512(p);
      r[q][1] = _mm512_loadu_si512(p + 64);
      r[q][2] = _mm512_loadu_si512(p + 128);
    }
    for (int q = 0; q < CLM_N_STREAMS; q++) clm_block(k, acc[q], r[q][0], r[q][1], r[q][2]);
    if (dst)
      for (int q = 0; q < CLM_N_STREAMS; q++)
        clm_store(dst + q * S + offset, r[q][0], r[q][1], r[q][2]);
  }
  for (int i = 0; i < 3; i++) a[i] = acc[CLM_N_STREAMS - 1][i];
  for (int q = 0; q < CLM_N_STREAMS - 1; q++) {
    const uint32_t *f = clm_stream_fold[which][q];
    __m512i m = _mm512_set_epi64(f[1], f[0], f[1], f[0], f[1], f[0], f[1], f[0]);
    for (int i = 0; i < 3; i++) a[i] = _mm512_xor_si512(a[i], clm_mul(acc[q][i], m));
  }
}

/* Folds n_blocks blocks of 192 bytes at src into a, copying them to dst (64-byte aligned)
 * unless it is NULL: four streams while at least 6 KiB are left, then one, whose reads run 4
 * KiB ahead, into `next` near the end as in copy_crc_blocks. */
CLM_TARGET static inline void clm_run(const clm_ctx *k, __m512i a[3], char *dst, const char *src,
                                      size_t n_blocks, const char *next) {
  size_t n = n_blocks * 192, i = 0;
  for (int which = 0; which < 4; which++) {
    size_t S = clm_stream_bytes[which];
    for (; n - i >= CLM_N_STREAMS * S; i += CLM_N_STREAMS * S)
      clm_streams(k, a, dst ? dst + i : NULL, src + i, S, which);
  }
  const char *end = src + n;
  for (; i < n; i += 192) {
    const char *p = src + i;
    const char *ahead = p + 4096;
    if (ahead >= end && next) ahead = next + (ahead - end);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    __m512i r0 = _mm512_loadu_si512(p), r1 = _mm512_loadu_si512(p + 64),
            r2 = _mm512_loadu_si512(p + 128);
    clm_block(k, a, r0, r1, r2);
    if (dst) clm_store(dst + i, r0, r1, r2);
  }
}

/* The lanes continued over n_blocks blocks at src (copied to dst unless it is NULL). */
CLM_TARGET static void clm_lanes(uint32_t lanes[3], char *dst, const char *src, size_t n_blocks,
                                 const char *next) {
  if (n_blocks == 0) return;
  clm_ctx k = clm_context();
  __m512i a[3];
  clm_start(a, lanes);
  clm_run(&k, a, dst, src, n_blocks, next);
  clm_finish(lanes, a);
}

/* Four pieces at once: reads run this far ahead in each. */
#define CLM_PIECE_AHEAD 1024

/* Four whole pieces at once, 192 bytes of each in turn, each with its own lanes (dst[q] NULL:
 * checksum only): four streams as in clm_streams, without joining them (faster than one piece
 * at a time: docs/decisions/0002). Past
 * the shortest piece, each finishes alone. next[q]: what is read after piece q, to read ahead
 * into. */
CLM_TARGET static void clm_four_pieces(const char *const src[4], char *const dst[4],
                                       const size_t n[4], uint64_t digests[4],
                                       const char *const next[4]) {
  clm_ctx k = clm_context();
  tps_sum64_state state[4];
  const char *sp[4];
  char *dp[4];
  size_t blocks[4], common = SIZE_MAX;
  __m512i a[4][3];
  for (int q = 0; q < 4; q++) {
    size_t head = dst[q] ? line_head(dst[q], n[q]) : 0;
    tps_sum64_init(&state[q]);
    tps_sum64_update(&state[q], src[q], head);
    if (dst[q]) memcpy(dst[q], src[q], head);
    sp[q] = src[q] + head;
    dp[q] = dst[q] ? dst[q] + head : NULL;
    blocks[q] = (n[q] - head) / 192;
    if (blocks[q] < common) common = blocks[q];
    clm_start(a[q], state[q].lanes);
  }
  int copy = dst[0] != NULL;
  for (size_t offset = 0; offset < common * 192; offset += 192) {
    for (int q = 0; q < 4; q++) {
      size_t ahead = offset + CLM_PIECE_AHEAD, own = blocks[q] * 192;
      const char *p = ahead < own ? sp[q] + ahead : next[q] ? next[q] + (ahead - own) : NULL;
      if (p) {
        _mm_prefetch(p, _MM_HINT_T0);
        _mm_prefetch(p + 64, _MM_HINT_T0);
        _mm_prefetch(p + 128, _MM_HINT_T0);
      }
    }
    __m512i r[4][3];
    for (int q = 0; q < 4; q++) {
      r[q][0] = _mm512_loadu_si512(sp[q] + offset);
      r[q][1] = _mm512_loadu_si512(sp[q] + offset + 64);
      r[q][2] = _mm512_loadu_si512(sp[q] + offset + 128);
    }
    for (int q = 0; q < 4; q++) clm_block(&k, a[q], r[q][0], r[q][1], r[q][2]);
    if (copy)
      for (int q = 0; q < 4; q++) clm_store(dp[q] + offset, r[q][0], r[q][1], r[q][2]);
  }
  for (int q = 0; q < 4; q++) {
    size_t done = common * 192, end = blocks[q] * 192;
    clm_run(&k, a[q], dp[q] ? dp[q] + done : NULL, sp[q] + done, blocks[q] - common, next[q]);
    if (blocks[q]) clm_finish(state[q].lanes, a[q]);
    state[q].total += end;
    size_t tail = n[q] - (size_t)(sp[q] - src[q]) - end;
    tps_sum64_update(&state[q], sp[q] + end, tail);
    if (dp[q]) memcpy(dp[q] + end, sp[q] + end, tail);
    digests[q] = tps_sum64_digest(&state[q]);
  }
}

static int have_clmul512(void) {
  static int cached = -1;
  if (cached < 0)
    cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
             __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.2");
  return cached && *force_portable == 0;
}
#define CLM_MIN_BLOCKS 16 /* 3 KiB: where setting up and finishing pay off (0002) */

/* --- The same folds with 128-bit PCLMULQDQ (CPUs without AVX-512, e.g. AMD Zen 2/3) -----------
 * The twelve slots of the 512-bit code, one register each: slot 3t + l holds lane l's words
 * (l + 6t, l + 6t + 3) of each block, folded by x^512 per block with the same constants and
 * joined at the end as clm_finish does. On such CPUs the crc32 instruction reaches a few GB/s
 * on one core, below a copy; twelve independent folds keep the multiplier busy instead. */
#define CLM128_TARGET __attribute__((target("pclmul,sse4.1,sse4.2")))

CLM128_TARGET static inline __m128i clm128_mul(__m128i acc, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(acc, k, 0x00), _mm_clmulepi64_si128(acc, k, 0x11));
}

/* Folds one 192-byte block into the slots, copying it to dst (16-byte aligned) unless NULL. */
CLM128_TARGET static inline void clm128_block(__m128i a[12], __m128i fold, const char *src,
                                              char *dst) {
  for (int t = 0; t < 4; t++) {
    const char *p = src + 48 * t;
    __m128i v0 = _mm_loadu_si128((const __m128i *)p);          /* words 6t, 6t+1 */
    __m128i v1 = _mm_loadu_si128((const __m128i *)(p + 16));   /* 6t+2, 6t+3 */
    __m128i v2 = _mm_loadu_si128((const __m128i *)(p + 32));   /* 6t+4, 6t+5 */
    if (dst) {
      _mm_stream_si128((__m128i *)(dst + 48 * t), v0);
      _mm_stream_si128((__m128i *)(dst + 48 * t + 16), v1);
      _mm_stream_si128((__m128i *)(dst + 48 * t + 32), v2);
    }
    a[3 * t] = _mm_xor_si128(clm128_mul(a[3 * t], fold), _mm_blend_epi16(v0, v1, 0xF0));
    a[3 * t + 1] = _mm_xor_si128(clm128_mul(a[3 * t + 1], fold), _mm_alignr_epi8(v2, v0, 8));
    a[3 * t + 2] = _mm_xor_si128(clm128_mul(a[3 * t + 2], fold), _mm_blend_epi16(v1, v2, 0xF0));
  }
}

/* The lanes continued over n_blocks blocks at src (copied to dst unless NULL; reads run 4 KiB
 * ahead, into `next` near the end, as in copy_crc_blocks). */
CLM128_TARGET static void clm128_lanes(uint32_t lanes[3], char *dst, const char *src,
                                       size_t n_blocks, const char *next) {
  if (n_blocks == 0) return;
  __m128i a[12];
  for (int s = 0; s < 12; s++) a[s] = _mm_setzero_si128();
  for (int l = 0; l < 3; l++) a[l] = _mm_set_epi64x((long long)clm_entry(lanes[l]), 0);
  const __m128i fold = _mm_set_epi64x((long long)clm_fold512[1], (long long)clm_fold512[0]);
  const char *end = src + n_blocks * 192;
  for (size_t i = 0; i < n_blocks; i++) {
    const char *p = src + i * 192;
    const char *ahead = p + 4096;
    if (ahead >= end && next) ahead = next + (ahead - end);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    clm128_block(a, fold, p, dst ? dst + i * 192 : NULL);
  }
  /* slots of t = 0, 1, 2 folded by x^384, x^256, x^128; t = 3 added as it is */
  static const uint64_t last[3][2] = {{CLM_F384}, {CLM_F256}, {CLM_F128}};
  for (int l = 0; l < 3; l++) {
    __m128i sum = a[9 + l];
    for (int t = 0; t < 3; t++)
      sum = _mm_xor_si128(sum,
                          clm128_mul(a[3 * t + l], _mm_loadu_si128((const __m128i *)last[t])));
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(sum);
    uint64_t hi = (uint64_t)_mm_extract_epi64(sum, 1);
    lanes[l] = (uint32_t)__builtin_ia32_crc32di(__builtin_ia32_crc32di(0, lo), hi);
  }
}

/* 0: the fastest path (this one where AVX-512 is missing); 3: this one even where it is not. */
static int have_clmul128(void) {
  static int cached = -1;
  if (cached < 0)
    cached = __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1") &&
             __builtin_cpu_supports("sse4.2");
  return cached && (*force_portable == 0 || *force_portable == 3);
}
#endif

static void lanes_portable(uint32_t lanes[3], const uint8_t *p, size_t n_groups) {
  ensure_table();
  for (size_t i = 0; i < n_groups; i++, p += 24) {
    lanes[0] = crc_word_portable(lanes[0], load64(p));
    lanes[1] = crc_word_portable(lanes[1], load64(p + 8));
    lanes[2] = crc_word_portable(lanes[2], load64(p + 16));
  }
}

/* The kernel sum64 runs its whole 192-byte blocks through (at least CLM_MIN_BLOCKS of them for
 * the carry-less ones), under the path flag on this CPU: the one choice feed_groups, the fused
 * copy and tps_checksum_kernel all read, so the tests see what runs. */
enum { KERNEL_TABLE, KERNEL_CRC32, KERNEL_CLMUL128, KERNEL_CLMUL512 };
static int sum64_kernel(void) {
#if defined(__x86_64__)
  if (have_clmul512()) return KERNEL_CLMUL512;
  if (have_clmul128()) return KERNEL_CLMUL128;
  if (have_sse42()) return KERNEL_CRC32;
#endif
  return KERNEL_TABLE;
}

static void feed_groups(uint32_t lanes[3], const uint8_t *p, size_t n_groups) {
#if defined(__x86_64__)
  int kernel = sum64_kernel();
  if (n_groups >= CLM_MIN_BLOCKS * 8 && kernel >= KERNEL_CLMUL128) {
    size_t blocks = n_groups / 8;
    if (kernel == KERNEL_CLMUL512)
      clm_lanes(lanes, NULL, (const char *)p, blocks, NULL);
    else
      clm128_lanes(lanes, NULL, (const char *)p, blocks, NULL);
    p += blocks * 192;
    n_groups -= blocks * 8;
  }
  if (kernel >= KERNEL_CRC32) {
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

void tps_checksum_force_portable(int on) { *force_portable = on; }

const char *tps_checksum_kernel(void) {
  static const char *const names[] = {"table", "crc32", "clmul128", "clmul512"};
  return names[sum64_kernel()];
}
int *tps_checksum_path_flag(void) { return force_portable; }
void tps_checksum_share_path_flag(int *flag) { force_portable = flag; }

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
    if (!fill_pending(s->pending, &s->n_pending, 24, &p, &n)) return;
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
/* The fused copy with the CRC instruction alone (no AVX-512): 192 bytes per step, 12 streamed
 * 16-byte stores and 8 words for each of the three lanes. */
#define PREFETCH_AHEAD 4096
__attribute__((target("sse4.2"))) static inline void crc_block(uint64_t *a, uint64_t *b,
                                                               uint64_t *c, const char *src) {
  uint64_t x = *a, y = *b, z = *c;
  for (int w = 0; w < 192; w += 24) {
    x = __builtin_ia32_crc32di(x, load64((const uint8_t *)src + w));
    y = __builtin_ia32_crc32di(y, load64((const uint8_t *)src + w + 8));
    z = __builtin_ia32_crc32di(z, load64((const uint8_t *)src + w + 16));
  }
  *a = x, *b = y, *c = z;
}

__attribute__((target("sse4.2"))) static void copy_crc_blocks(uint32_t lanes[3], char *dst,
                                                              const char *src, size_t blocks,
                                                              const char *end, const char *next) {
  uint64_t a = lanes[0], b = lanes[1], c = lanes[2];
  if (blocks) crc_block(&a, &b, &c, src);
  for (size_t i = 0; i < blocks; i++, src += 192, dst += 192) {
    /* Reads run 4 KiB ahead: one sequential stream is latency-bound without it (0002). Near
     * the end of the piece, they run
     * into the next piece the caller reads instead (harmless when it is NULL or short). */
    const char *ahead = src + PREFETCH_AHEAD;
    if (ahead >= end && next) ahead = next + (ahead - end);
    _mm_prefetch(ahead, _MM_HINT_T0);
    _mm_prefetch(ahead + 64, _MM_HINT_T0);
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    /* The checksum runs a step ahead of the copy (its loads bring the lines in): when dst is a
     * little past src modulo 4 KiB, loads right behind the stores wait on them as if they
     * aliased (docs/decisions/0002). */
    if (i + 1 < blocks) crc_block(&a, &b, &c, src + 192);
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
  int kernel = sum64_kernel();
  if (kernel < KERNEL_CRC32 || s->n_pending != 0) return 0;
  if ((uintptr_t)dst % 8 != 0) return 0;
  size_t head = line_head(dst, n);
  const char *sp = src;
  char *dp = dst;
  tps_sum64_update(s, sp, head);
  memcpy(dp, sp, head);
  sp += head;
  dp += head;
  n -= head;
  size_t blocks = n / 192;
  if (kernel == KERNEL_CLMUL512)
    clm_lanes(s->lanes, dp, sp, blocks, next);
  else if (blocks >= CLM_MIN_BLOCKS && kernel == KERNEL_CLMUL128)
    clm128_lanes(s->lanes, dp, sp, blocks, next);
  else
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

int tps_sum64_pieces(size_t count, const void *const src[], void *const dst[], const size_t n[],
                     uint64_t digests[], const void *next) {
#if defined(__x86_64__)
  if (!have_clmul512()) return 0;
  if (dst)
    for (size_t i = 0; i < count; i++)
      if ((uintptr_t)dst[i] % 8 != 0) return 0;
  for (size_t i = 0; i < count;) {
    if (count - i >= 4) {
      const char *s4[4], *next4[4];
      char *d4[4];
      for (int q = 0; q < 4; q++) {
        s4[q] = src[i + q];
        d4[q] = dst ? dst[i + q] : NULL;
        next4[q] = i + 4 + q < count ? src[i + 4 + q] : q == 0 ? next : NULL;
      }
      clm_four_pieces(s4, d4, n + i, digests + i, next4);
      i += 4;
      continue;
    }
    /* fewer than four left: one at a time, in four streams of its own where it is large */
    const void *after = i + 1 < count ? src[i + 1] : next;
    tps_sum64_state state;
    tps_sum64_init(&state);
    if (dst)
      tps_sum64_copy_streaming_next(&state, dst[i], src[i], n[i], after);
    else
      tps_sum64_update(&state, src[i], n[i]);
    digests[i] = tps_sum64_digest(&state);
    i++;
  }
  return 1;
#else
  (void)count, (void)src, (void)dst, (void)n, (void)digests, (void)next;
  return 0;
#endif
}
