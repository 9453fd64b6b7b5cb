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

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_CHECKSUM_H */
