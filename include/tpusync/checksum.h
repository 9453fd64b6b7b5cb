/* tpusync checksums: XXH64 (the published xxHash 64-bit algorithm, seed 0 unless given),
 * written for tpusync, incremental over 32-byte stripes so that it can run in the same pass as
 * a copy. */
#ifndef TPUSYNC_CHECKSUM_H
#define TPUSYNC_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tps_xxh64_state {
  uint64_t lanes[4];
  uint64_t seed;
  uint64_t total;     /* bytes consumed so far */
  uint8_t pending[32]; /* a partial stripe */
  uint32_t n_pending;
} tps_xxh64_state;

void tps_xxh64_init(tps_xxh64_state *state, uint64_t seed);
void tps_xxh64_update(tps_xxh64_state *state, const void *data, size_t n);
uint64_t tps_xxh64_digest(const tps_xxh64_state *state);

/* One-shot digest of n bytes. */
uint64_t tps_xxh64(const void *data, size_t n, uint64_t seed);

/* CRC-32C (Castagnoli, reflected, init and final xor 0xFFFFFFFF) of n bytes, continuing from
 * a previous value (0 for a fresh start): crc32c("123456789") == 0xE3069283. */
uint32_t tps_crc32c(uint32_t crc, const void *data, size_t n);

/* The raw CRC-32C value c (no pre/post inversion) continued over m zero bytes: c * x^(8m) mod
 * the polynomial. Joins lanes computed over consecutive pieces apart:
 * raw(c, A || B) == tps_crc32c_shift(raw(c, A), |B|) ^ raw(0, B). */
uint32_t tps_crc32c_shift(uint32_t c, uint64_t m);

/* The piece checksum of tpusync's stored blocks (format 1): three CRC-32C lanes over the
 * data's 8-byte words (word i feeds lane i % 3, so the three run in parallel), the trailing
 * bytes fed to lane 0, and the lanes and the length mixed into 64 bits. Incremental; any
 * split of the input gives the same result. */
typedef struct tps_sum64_state {
  uint32_t lanes[3];
  uint64_t total;
  uint8_t pending[24];
  uint32_t n_pending;
} tps_sum64_state;

void tps_sum64_init(tps_sum64_state *state);
void tps_sum64_update(tps_sum64_state *state, const void *data, size_t n);
uint64_t tps_sum64_digest(const tps_sum64_state *state);
uint64_t tps_sum64(const void *data, size_t n);

/* Copies n bytes from src to dst with non-temporal stores while feeding them to the checksum,
 * in one pass. Returns 0 (doing nothing) where the fast path does not apply: no SSE4.2, or a
 * destination that cannot be aligned to 16 bytes at a 24-byte group boundary of the checksum. */
int tps_sum64_copy_streaming(tps_sum64_state *state, void *dst, const void *src, size_t n);
/* The same, prefetching `next` (where the caller reads on after this piece; may be NULL) while
 * the end of this piece is copied: pieces of a few KiB are otherwise all latency. */
int tps_sum64_copy_streaming_next(tps_sum64_state *state, void *dst, const void *src, size_t n,
                                  const void *next);

/* Forces the portable (table) CRC-32C code instead of the CPU's instruction: for tests. */
void tps_checksum_force_portable(int on);

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_CHECKSUM_H */
