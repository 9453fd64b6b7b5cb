/* Float conversions of weights as they land, and per-channel absolute maxima (convert.c). */
#ifndef TPUSYNC_CONVERT_H
#define TPUSYNC_CONVERT_H

#include <stddef.h>

enum { TPS_F32 = 0, TPS_BF16 = 1, TPS_F8E4M3FN = 2, TPS_F8E5M2 = 3 };

/* Converts rows x cols values (C order) of src_kind at src to dst_kind at dst; an fp8 value is
 * multiplied first by factors[0] (n_factors 1) or by factors[c] of its column (n_factors ==
 * cols). Returns 0, or -1 for kinds or factors it does not take. */
int tps_convert(const void *src, int src_kind, void *dst, int dst_kind, size_t rows, size_t cols,
                const float *factors, size_t n_factors);

/* amax[c] = max(amax[c], |x|) over column c of rows x cols values of src_kind; a NaN stays. */
int tps_channel_amax(const void *src, int src_kind, size_t rows, size_t cols, float *amax);

#endif
