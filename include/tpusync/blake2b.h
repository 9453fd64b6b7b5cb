/* BLAKE2b (RFC 7693), keyed and personalised, for tpusync's block-key chains.
 *
 * Written from the RFC's description; checked against Python's hashlib.blake2b in the tests.
 * Only the sequential mode (fanout 1, depth 1) with a key, an optional 16-byte personalisation
 * and no salt: what the ``blake2b-chain-v1`` key scheme uses (see tpusync/kv/keys.py). */
#ifndef TPUSYNC_BLAKE2B_H
#define TPUSYNC_BLAKE2B_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tps_blake2b {
  uint64_t h[8];        /* chain value */
  uint64_t counter;     /* bytes compressed so far (2^64 is plenty here) */
  uint8_t block[128];   /* bytes not yet compressed */
  size_t filled;        /* of block */
  size_t digest_bytes;  /* 1..64 */
} tps_blake2b;

/* Starts a hash of ``digest_bytes`` (1..64) keyed by ``key`` (0..64 bytes) with the
 * personalisation ``person`` (up to 16 bytes, zero-padded). Returns 0, or -1 on bad sizes. */
int tps_blake2b_init(tps_blake2b *state, size_t digest_bytes, const void *key, size_t key_bytes,
                     const void *person, size_t person_bytes);
void tps_blake2b_update(tps_blake2b *state, const void *data, size_t n);
/* Writes the digest (``digest_bytes``); the state is spent afterwards. */
void tps_blake2b_final(tps_blake2b *state, uint8_t *out);

/* The key chain: for i in [0, n), value_i = BLAKE2b(prefix, value_{i-1} || data[i*step ..]),
 * value_{-1} = ``start`` (``digest_bytes`` long); writes the n values one after another into
 * ``out`` (n * digest_bytes). ``prefix`` is an initialised state (key and personalisation
 * absorbed), copied for each value. */
void tps_blake2b_chain(const tps_blake2b *prefix, const uint8_t *start, const uint8_t *data,
                       size_t step, size_t n, uint8_t *out);

#ifdef __cplusplus
}
#endif
#endif
