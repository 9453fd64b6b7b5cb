/* Poly1305 (RFC 8439); see include/tpusync/poly1305.h. */
#include "tpusync/poly1305.h"

#include <string.h>

typedef unsigned __int128 u128;

#define MASK44 ((uint64_t)0xfffffffffffULL)
#define MASK42 ((uint64_t)0x3ffffffffffULL)

static inline uint64_t load64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8); /* x86-64 and aarch64 Linux are little-endian */
  return v;
}

static inline void store64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

typedef struct {
  uint64_t r0, r1, r2;  /* clamped r in 44/44/42-bit limbs */
  uint64_t s1, s2;      /* r1 * 20, r2 * 20: 2^132 = 4 * 2^130 = 4 * 5 (mod 2^130 - 5) */
  uint64_t h0, h1, h2;  /* accumulator */
} state;

static void init(state *st, const uint8_t key[32]) {
  uint64_t t0 = load64(key) & 0x0ffffffc0fffffffULL;  /* the RFC's clamp of r */
  uint64_t t1 = load64(key + 8) & 0x0ffffffc0ffffffcULL;
  st->r0 = t0 & MASK44;
  st->r1 = ((t0 >> 44) | (t1 << 20)) & MASK44;
  st->r2 = (t1 >> 24) & MASK42;
  st->s1 = st->r1 * 20;
  st->s2 = st->r2 * 20;
  st->h0 = st->h1 = st->h2 = 0;
}

/* h * r (mod 2^130 - 5) for limbs of any two numbers below 2^130 (or barely above). */
static inline void multiply(uint64_t h0, uint64_t h1, uint64_t h2, uint64_t r0, uint64_t r1,
                            uint64_t r2, u128 *d0, u128 *d1, u128 *d2) {
  const uint64_t s1 = r1 * 20, s2 = r2 * 20;
  *d0 = (u128)h0 * r0 + (u128)h1 * s2 + (u128)h2 * s1;
  *d1 = (u128)h0 * r1 + (u128)h1 * r0 + (u128)h2 * s2;
  *d2 = (u128)h0 * r2 + (u128)h1 * r1 + (u128)h2 * r0;
}

static inline void carry(u128 d0, u128 d1, u128 d2, uint64_t *h0, uint64_t *h1, uint64_t *h2) {
  uint64_t c = (uint64_t)(d0 >> 44);
  *h0 = (uint64_t)d0 & MASK44;
  d1 += c;
  c = (uint64_t)(d1 >> 44);
  *h1 = (uint64_t)d1 & MASK44;
  d2 += c;
  c = (uint64_t)(d2 >> 42);
  *h2 = (uint64_t)d2 & MASK42;
  *h0 += c * 5;
  c = *h0 >> 44;
  *h0 &= MASK44;
  *h1 += c;
}

/* Two full blocks a step: h = (h + m1) * r^2 + m2 * r, the same value as two steps of
 * (h + m) * r, with two independent product chains for the CPU to overlap. */
static size_t block_pairs(state *st, const uint8_t *m, size_t n) {
  const uint64_t high = (uint64_t)1 << 40;
  const uint64_t r0 = st->r0, r1 = st->r1, r2 = st->r2;
  uint64_t q0, q1, q2; /* r^2 */
  u128 e0, e1, e2;
  multiply(r0, r1, r2, r0, r1, r2, &e0, &e1, &e2);
  carry(e0, e1, e2, &q0, &q1, &q2);
  uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2;
  size_t done = 0;
  for (; n - done >= 32; m += 32, done += 32) {
    uint64_t a0 = load64(m), a1 = load64(m + 8), b0 = load64(m + 16), b1 = load64(m + 24);
    h0 += a0 & MASK44;
    h1 += ((a0 >> 44) | (a1 << 20)) & MASK44;
    h2 += ((a1 >> 24) & MASK42) | high;
    uint64_t g0 = b0 & MASK44, g1 = ((b0 >> 44) | (b1 << 20)) & MASK44;
    uint64_t g2 = ((b1 >> 24) & MASK42) | high;
    u128 d0, d1, d2, f0, f1, f2;
    multiply(h0, h1, h2, q0, q1, q2, &d0, &d1, &d2);
    multiply(g0, g1, g2, r0, r1, r2, &f0, &f1, &f2);
    carry(d0 + f0, d1 + f1, d2 + f2, &h0, &h1, &h2);
  }
  st->h0 = h0;
  st->h1 = h1;
  st->h2 = h2;
  return done;
}

/* Adds each 16-byte block (plus ``high``, the 2^128 bit of a full block) and multiplies by r. */
static void blocks(state *st, const uint8_t *m, size_t n, uint64_t high) {
  const uint64_t r0 = st->r0, r1 = st->r1, r2 = st->r2, s1 = st->s1, s2 = st->s2;
  uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2;
  for (; n >= 16; m += 16, n -= 16) {
    uint64_t m0 = load64(m), m1 = load64(m + 8);
    h0 += m0 & MASK44;
    h1 += ((m0 >> 44) | (m1 << 20)) & MASK44;
    h2 += ((m1 >> 24) & MASK42) | high;
    u128 d0 = (u128)h0 * r0 + (u128)h1 * s2 + (u128)h2 * s1;
    u128 d1 = (u128)h0 * r1 + (u128)h1 * r0 + (u128)h2 * s2;
    u128 d2 = (u128)h0 * r2 + (u128)h1 * r1 + (u128)h2 * r0;
    uint64_t c = (uint64_t)(d0 >> 44);
    h0 = (uint64_t)d0 & MASK44;
    d1 += c;
    c = (uint64_t)(d1 >> 44);
    h1 = (uint64_t)d1 & MASK44;
    d2 += c;
    c = (uint64_t)(d2 >> 42);
    h2 = (uint64_t)d2 & MASK42;
    h0 += c * 5;
    c = h0 >> 44;
    h0 &= MASK44;
    h1 += c;
  }
  st->h0 = h0;
  st->h1 = h1;
  st->h2 = h2;
}

static void finish(state *st, const uint8_t key[32], uint8_t tag[16]) {
  uint64_t h0 = st->h0, h1 = st->h1, h2 = st->h2, c;
  /* Carry fully: h < 2^130 with every limb in range. */
  c = h1 >> 44; h1 &= MASK44; h2 += c;
  c = h2 >> 42; h2 &= MASK42; h0 += c * 5;
  c = h0 >> 44; h0 &= MASK44; h1 += c;
  c = h1 >> 44; h1 &= MASK44; h2 += c;
  c = h2 >> 42; h2 &= MASK42; h0 += c * 5;
  c = h0 >> 44; h0 &= MASK44; h1 += c;
  /* g = h - p = h + 5 - 2^130; take g where it is not negative (in constant time). */
  uint64_t g0 = h0 + 5;
  c = g0 >> 44; g0 &= MASK44;
  uint64_t g1 = h1 + c;
  c = g1 >> 44; g1 &= MASK44;
  uint64_t g2 = h2 + c - ((uint64_t)1 << 42);
  uint64_t keep_g = (g2 >> 63) - 1; /* all ones when g2 did not go negative */
  h0 = (h0 & ~keep_g) | (g0 & keep_g);
  h1 = (h1 & ~keep_g) | (g1 & keep_g);
  h2 = (h2 & ~keep_g) | (g2 & MASK42 & keep_g);
  /* tag = (h + s) mod 2^128 */
  uint64_t t0 = h0 | (h1 << 44);
  uint64_t t1 = (h1 >> 20) | (h2 << 24);
  uint64_t s0 = load64(key + 16), s1 = load64(key + 24);
  u128 sum = (u128)t0 + s0;
  t0 = (uint64_t)sum;
  t1 = t1 + s1 + (uint64_t)(sum >> 64);
  store64(tag, t0);
  store64(tag + 8, t1);
}

void tps_poly1305(const uint8_t key[32], const void *data, size_t n, uint8_t tag[16]) {
  state st;
  const uint8_t *m = (const uint8_t *)data;
  init(&st, key);
  size_t whole = n & ~(size_t)15;
  size_t paired = block_pairs(&st, m, whole);
  blocks(&st, m + paired, whole - paired, (uint64_t)1 << 40);
  if (n > whole) { /* the last partial block: its bytes, then 1, then zeros; no 2^128 bit */
    uint8_t last[16] = {0};
    memcpy(last, m + whole, n - whole);
    last[n - whole] = 1;
    blocks(&st, last, 16, 0);
  }
  finish(&st, key, tag);
}

void tps_poly1305_many(const uint8_t *keys, const uint64_t *starts, const uint64_t *lengths,
                       size_t count, uint8_t *tags) {
  for (size_t i = 0; i < count; i++) {
    tps_poly1305(keys + 32 * i, (const void *)(uintptr_t)starts[i], (size_t)lengths[i],
                 tags + 16 * i);
  }
}
