/* XXH64, implemented from the algorithm's public description (see checksum.h). */
#include "tpusync/checksum.h"

#include <string.h>

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
