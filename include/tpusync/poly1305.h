/* Poly1305 (RFC 8439, section 2.5): a one-time authenticator for block payloads.
 *
 * Written from the RFC's description; checked against the RFC's test vector and an independent
 * implementation in the tests. A key (r, s) must authenticate one message only: callers derive
 * a fresh key per block write (see tpusync/tiers/mac.py). Scalar 64-bit code (three 44/44/42-bit
 * limbs, products in unsigned __int128). */
#ifndef TPUSYNC_POLY1305_H
#define TPUSYNC_POLY1305_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Writes the 16-byte tag of ``n`` bytes at ``data`` under the 32-byte ``key`` to ``tag``. */
void tps_poly1305(const uint8_t key[32], const void *data, size_t n, uint8_t tag[16]);

/* The tags of ``count`` messages: message i is ``lengths[i]`` bytes at address ``starts[i]``,
 * keyed by ``keys + 32 * i``; its tag goes to ``tags + 16 * i``. */
void tps_poly1305_many(const uint8_t *keys, const uint64_t *starts, const uint64_t *lengths,
                       size_t count, uint8_t *tags);

#ifdef __cplusplus
}
#endif

#endif /* TPUSYNC_POLY1305_H */
