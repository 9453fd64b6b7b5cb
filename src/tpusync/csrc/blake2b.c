/* BLAKE2b (RFC 7693) for tpusync's block-key chains; see include/tpusync/blake2b.h. */
#include "tpusync/blake2b.h"

#include <string.h>

static const uint64_t kInit[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL,
};

/* Message word order of each round (rounds 10 and 11 repeat rounds 0 and 1). */
static const uint8_t kSchedule[10][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
};

static inline uint64_t rotr(uint64_t x, unsigned n) { return (x >> n) | (x << (64 - n)); }

static inline uint64_t load_le(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static inline void store_le(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

#define MIX(a, b, c, d, x, y)     \
  do {                            \
    a = a + b + (x);              \
    d = rotr(d ^ a, 32);          \
    c = c + d;                    \
    b = rotr(b ^ c, 24);          \
    a = a + b + (y);              \
    d = rotr(d ^ a, 16);          \
    c = c + d;                    \
    b = rotr(b ^ c, 63);          \
  } while (0)

static void compress(uint64_t h[8], const uint8_t block[128], uint64_t counter, int last) {
  uint64_t m[16], v[16];
  for (int i = 0; i < 16; i++) m[i] = load_le(block + 8 * i);
  for (int i = 0; i < 8; i++) {
    v[i] = h[i];
    v[i + 8] = kInit[i];
  }
  v[12] ^= counter; /* the counter's high word stays 0: inputs are far below 2^64 bytes */
  if (last) v[14] = ~v[14];
  for (int round = 0; round < 12; round++) {
    const uint8_t *s = kSchedule[round % 10];
    MIX(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
    MIX(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
    MIX(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
    MIX(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
    MIX(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
    MIX(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
    MIX(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
    MIX(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
  }
  for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

int tps_blake2b_init(tps_blake2b *state, size_t digest_bytes, const void *key, size_t key_bytes,
                     const void *person, size_t person_bytes) {
  if (digest_bytes < 1 || digest_bytes > 64 || key_bytes > 64 || person_bytes > 16) return -1;
  uint8_t params[64];
  memset(params, 0, sizeof params);
  params[0] = (uint8_t)digest_bytes;
  params[1] = (uint8_t)key_bytes;
  params[2] = 1; /* fanout */
  params[3] = 1; /* depth */
  if (person_bytes) memcpy(params + 48, person, person_bytes);
  for (int i = 0; i < 8; i++) state->h[i] = kInit[i] ^ load_le(params + 8 * i);
  state->counter = 0;
  state->filled = 0;
  state->digest_bytes = digest_bytes;
  memset(state->block, 0, sizeof state->block);
  if (key_bytes) { /* the key, zero-padded, is the first block */
    memcpy(state->block, key, key_bytes);
    state->filled = 128;
  }
  return 0;
}

void tps_blake2b_update(tps_blake2b *state, const void *data, size_t n) {
  const uint8_t *in = (const uint8_t *)data;
  while (n > 0) {
    if (state->filled == 128) { /* a full block is compressed only once more input follows */
      state->counter += 128;
      compress(state->h, state->block, state->counter, 0);
      state->filled = 0;
    }
    size_t take = 128 - state->filled;
    if (take > n) take = n;
    memcpy(state->block + state->filled, in, take);
    state->filled += take;
    in += take;
    n -= take;
  }
}

void tps_blake2b_final(tps_blake2b *state, uint8_t *out) {
  uint8_t full[64];
  state->counter += state->filled;
  memset(state->block + state->filled, 0, 128 - state->filled);
  compress(state->h, state->block, state->counter, 1);
  for (int i = 0; i < 8; i++) store_le(full + 8 * i, state->h[i]);
  memcpy(out, full, state->digest_bytes);
}

void tps_blake2b_chain(const tps_blake2b *prefix, const uint8_t *start, const uint8_t *data,
                       size_t step, size_t n, uint8_t *out) {
  const size_t width = prefix->digest_bytes;
  const uint8_t *parent = start;
  tps_blake2b keyed = *prefix;
  if (keyed.filled == 128) { /* the key block: compressed once here, not once per value */
    keyed.counter += 128;
    compress(keyed.h, keyed.block, keyed.counter, 0);
    keyed.filled = 0;
  }
  for (size_t i = 0; i < n; i++) {
    tps_blake2b state = keyed;
    tps_blake2b_update(&state, parent, width);
    tps_blake2b_update(&state, data + i * step, step);
    tps_blake2b_final(&state, out + i * width);
    parent = out + i * width;
  }
}
