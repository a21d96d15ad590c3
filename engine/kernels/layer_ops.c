/*
 * The small operations between a decoder layer's matrix products, in
 * float32: RMSNorm, rotary embedding, the KV-cache write and SwiGLU's
 * silu(gate) * up.
 *
 * Why: a decode step of a small model runs about a dozen of these per layer
 * on a few rows each. In torch each is several operator calls, with their
 * dispatch, allocation and thread hand-offs; that cost rivals the arithmetic.
 * Here each is one call over all rows.
 *
 * Numerics follow transformers' modules:
 *   rms_norm: w * (x * (1 / sqrt(mean(x^2) + eps))), the mean summed in
 *     float32 (in 8 lanes, so only the summation order differs from torch);
 *   rope (half-split): x[i] * cos[i] + (-x[i + D/2]) * sin[i] for i < D/2 and
 *     x[i] * cos[i] + x[i - D/2] * sin[i] above, rounded as torch rounds it
 *     (this file is compiled with -ffp-contract=off): bit for bit torch's;
 *   silu_mul: g / (1 + exp(-g)) * u, exp by Cephes' degree-5 polynomial in
 *     AVX2 (within 2 ulp of expf; torch's own vector exp is not bit for bit
 *     the C library's either).
 * Every row is computed alone, in a fixed order: batch invariant.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_AVX2 1
#endif
#include "vector_math.h"

/* Rows worth a thread team; below this one thread is quicker. */
#define PARALLEL_VALUES 65536

/* out[r] = rms_norm(x[r]) * w for rows r of n values (x and out may alias). */
void metrale_rms_norm(const float *x, int64_t rows, int64_t n, const float *w, float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_VALUES) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float lane[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) lane[j] += xr[i + j] * xr[i + j];
        float total = 0.0f;
        for (int j = 0; j < 8; j++) total += lane[j];
        for (; i < n; i++) total += xr[i] * xr[i];
        const float scale = 1.0f / sqrtf(total / (float)n + eps);
        float *o = out + r * n;
        for (i = 0; i < n; i++) o[i] = w[i] * (xr[i] * scale);
    }
}

/* Rotates, in place, `heads` heads of D values in each of `rows` rows (row r
 * at x + r * stride) by the table rows of positions[r]: cos and sin are
 * [max_len, D]. */
void metrale_rope(float *x, int64_t stride, int64_t rows, int64_t heads, int64_t D, const float *cos_table,
                  const float *sin_table, const int64_t *positions) {
    const int64_t half = D / 2;
    for (int64_t r = 0; r < rows; r++) {
        const float *c = cos_table + positions[r] * D, *s = sin_table + positions[r] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + r * stride + h * D;
            for (int64_t i = 0; i < half; i++) {
                const float a = v[i], b = v[i + half];
                v[i] = a * c[i] + (-b) * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* Copies each packed row's keys and values (kv_heads heads of D values at
 * k + row * k_stride and v + row * v_stride) to its slot and position in one
 * layer's cache [slots, kv_heads, max_len, D]; seg as in attention.c:
 * [segments][4] = (slot, start, rows, first row). */
void metrale_kv_write(const float *k, int64_t k_stride, const float *v, int64_t v_stride, float *keys,
                      float *values, int64_t kv_heads, int64_t max_len, int64_t D, int64_t segments,
                      const int64_t *seg) {
    for (int64_t s = 0; s < segments; s++) {
        const int64_t slot = seg[4 * s], start = seg[4 * s + 1], rows = seg[4 * s + 2], row0 = seg[4 * s + 3];
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t base = ((slot * kv_heads + h) * max_len + start) * D;
            for (int64_t r = 0; r < rows; r++) {
                memcpy(keys + base + r * D, k + (row0 + r) * k_stride + h * D, sizeof(float) * D);
                memcpy(values + base + r * D, v + (row0 + r) * v_stride + h * D, sizeof(float) * D);
            }
        }
    }
}


/* out[r][i] = silu(gate_up[r][i]) * gate_up[r][n + i] for rows of 2n values. */
void metrale_silu_mul(const float *gate_up, int64_t rows, int64_t n, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * n >= PARALLEL_VALUES) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * n, *u = g + n;
        float *o = out + r * n;
        int64_t i = 0;
#ifdef METRALE_AVX2
        const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
            const __m256 gv = _mm256_loadu_ps(g + i);
            const __m256 sig = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(sig, _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
