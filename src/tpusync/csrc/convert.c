/* Float conversions of weights as they land (f32 and bf16 to f32, bf16, fp8 e4m3fn and fp8
 * e5m2, the fp8 ones multiplied by a factor first: the inverse of their scale) and the
 * per-channel absolute maxima the scales are made from. A multiplication, not a division: XLA
 * divides by multiplying with the reciprocal, so a quotient would not be bit for bit its own. Each result equals XLA's convert (jnp.astype) of the same f32 value: round to
 * nearest even; an fp8 value past the largest finite one is NaN (e4m3fn, which has no
 * infinity) or infinity (e5m2). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tpusync/convert.h"

static inline float from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline uint32_t to_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    return bits;
}

static inline float load(const void *src, int bf16, size_t i) {
    if (bf16) return from_bits((uint32_t)((const uint16_t *)src)[i] << 16); /* the high half */
    return ((const float *)src)[i];
}

static inline uint16_t to_bf16(float value) {
    uint32_t bits = to_bits(value);
    uint16_t rounded = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    uint16_t nan = (uint16_t)(((bits >> 16) & 0x8000u) | 0x7fc0u); /* sign kept */
    return value != value ? nan : rounded;
}

/* An fp8 with `mant` mantissa bits and exponent bias `bias`; `max_code` is its largest finite
 * magnitude's code, `overflow` the code of what lies past it. */
struct fp8 {
    int mant, bias;
    uint32_t max_code, overflow, nan_code;
};

static const struct fp8 E4M3FN = {3, 7, 0x7e, 0x7f, 0x7f}; /* no infinity: past it is NaN */
static const struct fp8 E5M2 = {2, 15, 0x7b, 0x7c, 0x7e};

/* n values to fp8 codes: integer operations and masks only, so the loop vectorizes */
static void fp8_codes(const float *values, uint8_t *dst, size_t n, struct fp8 f) {
    const int shift = 23 - f.mant;
    const uint32_t rebias = (uint32_t)(127 - f.bias) << f.mant;
    const uint32_t smallest_normal = (uint32_t)(127 + 1 - f.bias) << 23;
    /* below the smallest normal, adding 2^(24 - bias - mant) leaves one fp8 step as the sum's
     * last bit: the float addition rounds to a whole number of steps, to nearest even */
    const float offset = from_bits((uint32_t)(127 + 24 - f.bias - f.mant) << 23);
    const uint32_t offset_bits = to_bits(offset);
    const uint32_t max_code = f.max_code, overflow = f.overflow, nan_code = f.nan_code;
    size_t i;
    for (i = 0; i < n; i++) {
        uint32_t bits = to_bits(values[i]);
        uint32_t sign = (bits >> 24) & 0x80u;
        uint32_t magnitude = bits & 0x7fffffffu;
        uint32_t normal =
            ((magnitude + ((1u << (shift - 1)) - 1u) + ((magnitude >> shift) & 1u)) >> shift) -
            rebias;
        uint32_t small = to_bits(from_bits(magnitude) + offset) - offset_bits;
        uint32_t is_small = 0u - (uint32_t)(magnitude < smallest_normal); /* all ones or 0 */
        uint32_t code = (small & is_small) | (normal & ~is_small);
        uint32_t too_big = 0u - (uint32_t)(code > max_code);
        uint32_t is_nan = 0u - (uint32_t)(magnitude > 0x7f800000u);
        code = (overflow & too_big) | (code & ~too_big);
        code = (nan_code & is_nan) | (code & ~is_nan);
        dst[i] = (uint8_t)(sign | code);
    }
}

enum { BLOCK = 1024 };

/* Each value times its factor, then to fp8, a block of a row at a time */
static void to_fp8(const void *src, int bf16, uint8_t *dst, size_t rows, size_t cols,
                   const float *factors, int per_column, struct fp8 f) {
    float scaled[BLOCK];
    size_t r, start, c, n, i = 0;
    for (r = 0; r < rows; r++) {
        for (start = 0; start < cols; start += n, i += n) {
            n = cols - start < BLOCK ? cols - start : BLOCK;
            if (bf16) {
                const uint16_t *from = (const uint16_t *)src + i;
                if (per_column)
                    for (c = 0; c < n; c++)
                        scaled[c] = from_bits((uint32_t)from[c] << 16) * factors[start + c];
                else
                    for (c = 0; c < n; c++) scaled[c] = from_bits((uint32_t)from[c] << 16) * factors[0];
            } else {
                const float *from = (const float *)src + i;
                if (per_column)
                    for (c = 0; c < n; c++) scaled[c] = from[c] * factors[start + c];
                else
                    for (c = 0; c < n; c++) scaled[c] = from[c] * factors[0];
            }
            fp8_codes(scaled, dst + i, n, f);
        }
    }
}

static void to_float(const void *src, int bf16, void *dst, int dst_bf16, size_t n) {
    size_t i;
    if (dst_bf16)
        for (i = 0; i < n; i++) ((uint16_t *)dst)[i] = to_bf16(load(src, bf16, i));
    else
        for (i = 0; i < n; i++) ((float *)dst)[i] = load(src, bf16, i);
}

int tps_convert(const void *src, int src_kind, void *dst, int dst_kind, size_t rows, size_t cols,
                const float *factors, size_t n_factors) {
    int bf16 = src_kind == TPS_BF16, per_column = n_factors != 1;
    if ((src_kind != TPS_F32 && !bf16) || (n_factors != 1 && n_factors != cols)) return -1;
    switch (dst_kind) {
    case TPS_F32:
    case TPS_BF16:
        to_float(src, bf16, dst, dst_kind == TPS_BF16, rows * cols);
        return 0;
    case TPS_F8E4M3FN:
        to_fp8(src, bf16, dst, rows, cols, factors, per_column, E4M3FN);
        return 0;
    case TPS_F8E5M2:
        to_fp8(src, bf16, dst, rows, cols, factors, per_column, E5M2);
        return 0;
    default:
        return -1;
    }
}

int tps_channel_amax(const void *src, int src_kind, size_t rows, size_t cols, float *amax) {
    size_t r, c;
    int bf16 = src_kind == TPS_BF16, nan_seen = 0;
    if (src_kind != TPS_F32 && !bf16) return -1;
    for (r = 0; r < rows; r++) { /* NaN compares false: skipped here, marked below */
        for (c = 0; c < cols; c++) {
            float a = fabsf(load(src, bf16, r * cols + c));
            amax[c] = a > amax[c] ? a : amax[c];
            nan_seen |= a != a;
        }
    }
    if (nan_seen)
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++)
                if (isnan(load(src, bf16, r * cols + c))) amax[c] = NAN;
    return 0;
}
