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
 * split of the input gives the same result. The lanes run on the CPU's CRC instruction, or
 * with AVX-512 and VPCLMULQDQ by carry-less multiplication (the same values, faster next to a
 * copy), or on tables. */
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
 * in one pass. Returns 0 (doing nothing) where the fast path does not apply: no SSE4.2, a
 * state with a partial group pending, or a destination that is not 8-byte aligned (a head of
 * whole 24-byte groups aligns it to a cache line). */
int tps_sum64_copy_streaming(tps_sum64_state *state, void *dst, const void *src, size_t n);
/* The same, prefetching `next` (where the caller reads on after this piece; may be NULL) while
 * the end of this piece is copied: pieces of a few KiB are otherwise all latency. */
int tps_sum64_copy_streaming_next(tps_sum64_state *state, void *dst, const void *src, size_t n,
                                  const void *next);

/* The checksums of count whole pieces (digests[i] = tps_sum64 of piece i's n[i] bytes at
 * src[i]), each also copied to dst[i] with non-temporal stores unless dst is NULL: the fast path
 * for many pieces, which runs four at once (more reads in flight than one stream; a piece left
 * over runs in four streams of its own where it is large). `next` is where the caller reads on
 * afterwards (may be NULL). Returns 0 (doing nothing) where it does not apply: a CPU without
 * AVX-512 and VPCLMULQDQ, or a destination that is not 8-byte aligned. The caller fences the
 * stores (_mm_sfence) before others read them. */
int tps_sum64_pieces(size_t count, const void *const src[], void *const dst[], const size_t n[],
                     uint64_t digests[], const void *next);

/* For tests: 1 forces the portable (table) CRC-32C code instead of the CPU's instructions, 2
 * sum64 on the CRC instruction without its carry-less multiplication kernels, 3 sum64's 128-bit
 * carry-less multiplication kernel even where AVX-512 is there, 0 the fastest. */
void tps_checksum_force_portable(int on);
/* The kernel sum64 (and its fused copy) runs whole 192-byte blocks through under the current
 * choice, on this CPU: "clmul512", "clmul128" (for 16 blocks or more; fewer go through
 * "crc32"), "crc32" or "table". A forced path the CPU lacks falls back to another. */
const char *tps_checksum_kernel(void);
/* Where that choice is kept. Every module that links this file has its own; one of them hands
 * its flag to the others (tps_checksum_share_path_flag, before any checksum runs) so that one
 * choice holds in the whole process. */
int *tps_checksum_path_flag(void);
void tps_checksum_share_path_flag(int *flag);

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_CHECKSUM_H */
