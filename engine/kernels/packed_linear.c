/*
 * Linear layers over packed weights, computed in float32.
 *
 * Contract: out[m][n] = sum_k x[m][k] * w[n][k] for x [M, K] float32 and a
 * weight [N, K] kept packed (GGUF Q4_1 or Q8_0 blocks of 32 along K, or
 * bfloat16). A weight value is decoded with exactly the arithmetic gguf's
 * reference dequantizer uses (Q4_1: d * q, rounded, then + m, rounded;
 * Q8_0: d * q; bfloat16: a shift), so the float32 weight this file computes
 * with is bit-for-bit the one `metrale` writes to model.safetensors: the
 * model is the same, only fewer bytes cross the memory bus.
 *
 * Why: decoding a small model on a CPU is bound by memory bandwidth, and
 * float32 weights are 4 bytes each; Q4_1 is 0.625. A strip of NS weight rows
 * is decoded into a buffer that stays in the core's cache and every input
 * row is multiplied against it there.
 *
 * Batch invariance: each output is one 8-wide accumulator summed over k in
 * ascending order and reduced the same way, whatever M is and whichever
 * tile computed it. A row's result never depends on the rows beside it, so
 * a verify of 4 rows gives the same logits as 4 single-row steps (for as
 * many rows as the caller sends here: packed.py hands wide products to BLAS).
 *
 * Built on first use by metrale/engine/packed_kernel.py with the system C
 * compiler (-O3 -march=native -fopenmp -ffp-contract=off: no fused
 * multiply-add may merge the two roundings of the Q4_1 decode). OpenMP
 * resolves to the runtime torch has already loaded, so both share one
 * thread pool.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define METRALE_AVX2 1
#endif

enum { FORMAT_Q4_1 = 0, FORMAT_Q8_0 = 1, FORMAT_BF16 = 2 };
enum { NS = 8, BLOCK = 32 };

/* Decodes one weight row of K values. `data` points at the row's packed
 * values, `scales` at its per-block scales. */
typedef void (*decode_row_fn)(const uint8_t *data, const float *scales, float *out, int64_t K);

/* Q4_1: data [K/2] bytes, per block 16 bytes whose low nibbles are values
 * 0..15 and high nibbles 16..31; scales [K/32][2] = (d, m). */
static void decode_q4_1(const uint8_t *data, const float *scales, float *out, int64_t K) {
    for (int64_t b = 0; b < K / BLOCK; b++) {
        const uint8_t *qs = data + b * 16;
        const float d = scales[2 * b], m = scales[2 * b + 1];
        float *o = out + b * BLOCK;
#ifdef METRALE_AVX2
        __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
        __m128i lo = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
        __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
        __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
        __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; i++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
            _mm256_storeu_ps(o + 8 * i, _mm256_add_ps(_mm256_mul_ps(q, vd), vm));
        }
#else
        for (int j = 0; j < 16; j++) {
            o[j] = (float)(qs[j] & 0x0F) * d + m;
            o[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
#endif
    }
}

/* Q8_0: data [K] signed bytes; scales [K/32] = d. */
static void decode_q8_0(const uint8_t *data, const float *scales, float *out, int64_t K) {
    const int8_t *qs = (const int8_t *)data;
    for (int64_t b = 0; b < K / BLOCK; b++) {
        const float d = scales[b];
        float *o = out + b * BLOCK;
        const int8_t *q = qs + b * BLOCK;
#ifdef METRALE_AVX2
        __m256 vd = _mm256_set1_ps(d);
        for (int i = 0; i < 4; i++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * i));
            __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
            _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(v, vd));
        }
#else
        for (int j = 0; j < BLOCK; j++) o[j] = (float)q[j] * d;
#endif
    }
}

/* bfloat16: data [K] 16-bit values, the high half of a float32. */
static void decode_bf16(const uint8_t *data, const float *scales, float *out, int64_t K) {
    (void)scales; /* bfloat16 has none: callers pass a valid dummy pointer */
    const uint16_t *h = (const uint16_t *)data;
    for (int64_t k = 0; k < K; k++) {
        uint32_t bits = (uint32_t)h[k] << 16;
        memcpy(out + k, &bits, sizeof bits);
    }
}

static decode_row_fn decoder(int format, int64_t K, int64_t *row_bytes, int64_t *row_scales) {
    switch (format) {
    case FORMAT_Q4_1: *row_bytes = K / 2; *row_scales = 2 * (K / BLOCK); return decode_q4_1;
    case FORMAT_Q8_0: *row_bytes = K; *row_scales = K / BLOCK; return decode_q8_0;
    case FORMAT_BF16: *row_bytes = 2 * K; *row_scales = 0; return decode_bf16;
    default: return NULL;
    }
}

#ifdef METRALE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Rows m..m+3 of x against weight rows n, n+1: eight accumulators. */
static void tile_4x2(const float *x, int64_t K, const float *w, float *out, int64_t ldo) {
    __m256 acc[4][2];
    for (int i = 0; i < 4; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + K + k);
        for (int i = 0; i < 4; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * K + k);
            acc[i][0] = _mm256_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(xv, w1, acc[i][1]);
        }
    }
    for (int i = 0; i < 4; i++) {
        out[i * ldo] = hsum8(acc[i][0]);
        out[i * ldo + 1] = hsum8(acc[i][1]);
    }
}

/* Rows m..m+2 of x against weight rows n..n+3: twelve accumulators, enough
 * to keep both FMA pipes busy through their latency. */
static void tile_3x4(const float *x, int64_t K, const float *w, float *out, int64_t ldo) {
    __m256 acc[3][4];
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + K + k), x2 = _mm256_loadu_ps(x + 2 * K + k);
        for (int j = 0; j < 4; j++) {
            const __m256 wv = _mm256_loadu_ps(w + j * K + k);
            acc[0][j] = _mm256_fmadd_ps(x0, wv, acc[0][j]);
            acc[1][j] = _mm256_fmadd_ps(x1, wv, acc[1][j]);
            acc[2][j] = _mm256_fmadd_ps(x2, wv, acc[2][j]);
        }
    }
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 4; j++) out[i * ldo + j] = hsum8(acc[i][j]);
}

/* One row of x against ns <= NS weight rows. */
static void row_by_strip(const float *x, int64_t K, const float *w, int ns, float *out) {
    __m256 acc[NS];
    for (int n = 0; n < ns; n++) acc[n] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        for (int n = 0; n < ns; n++) acc[n] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + n * K + k), acc[n]);
    }
    for (int n = 0; n < ns; n++) out[n] = hsum8(acc[n]);
}
#else
/* Portable order matching the vector code: eight running lanes, then the
 * same pairwise reduction as hsum8. */
static float dot_lanes(const float *x, const float *w, int64_t K) {
    float lane[8] = {0};
    for (int64_t k = 0; k < K; k += 8)
        for (int j = 0; j < 8; j++) lane[j] = __builtin_fmaf(x[k + j], w[k + j], lane[j]);
    float a[4];
    for (int j = 0; j < 4; j++) a[j] = lane[j] + lane[j + 4];
    float b0 = a[0] + a[2], b1 = a[1] + a[3];
    return b0 + b1;
}
#endif

static void strip_product(const float *x, int64_t M, int64_t K, const float *w, int ns, float *out, int64_t N) {
#ifdef METRALE_AVX2
    /* Tiles of 3x4 pay from about 12 rows (batch 16: 5-12% faster than 4x2),
     * 4x2 below. Every tile and the row path sum each output in the same
     * order, so the choice never changes a result. */
    int64_t m = 0;
    if (ns == NS && M >= 12)
        for (; m + 3 <= M; m += 3)
            for (int n = 0; n < NS; n += 4) tile_3x4(x + m * K, K, w + n * K, out + m * N + n, N);
    if (ns == NS)
        for (; m + 4 <= M; m += 4)
            for (int n = 0; n < NS; n += 2) tile_4x2(x + m * K, K, w + n * K, out + m * N + n, N);
    for (; m < M; m++) row_by_strip(x + m * K, K, w, ns, out + m * N);
#else
    for (int64_t m = 0; m < M; m++)
        for (int n = 0; n < ns; n++) out[m * N + n] = dot_lanes(x + m * K, w + n * K, K);
#endif
}

/* out [M, N] = x [M, K] @ decode(weight)^T. Returns 0, or -1 for a bad
 * format or a K that is not a multiple of 32, or -2 when out of memory. */
int metrale_packed_linear(
    int format, const float *x, int64_t M, int64_t K, const uint8_t *data, const float *scales,
    int64_t N, float *out, int threads) {
    int64_t row_bytes, row_scales;
    decode_row_fn decode = decoder(format, K, &row_bytes, &row_scales);
    if (decode == NULL || K % BLOCK != 0) return -1;
    const int64_t strips = (N + NS - 1) / NS;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* Every thread reaches the worksharing loop, as OpenMP requires; one
         * without a buffer only reports the failure. */
        float *buf = (float *)malloc(sizeof(float) * NS * K);
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < strips; s++) {
            if (buf == NULL) continue;
            const int64_t n0 = s * NS;
            const int ns = (int)(N - n0 < NS ? N - n0 : NS);
            for (int n = 0; n < ns; n++)
                decode(data + (n0 + n) * row_bytes, scales + (n0 + n) * row_scales, buf + n * K, K);
            strip_product(x, M, K, buf, ns, out + n0, N);
        }
        free(buf);
    }
    return failed ? -2 : 0;
}

/* out [N, K] = decode(weight): for the wide products (prefill) that a BLAS
 * does faster, and for tests. */
int metrale_decode(int format, int64_t K, const uint8_t *data, const float *scales, int64_t N, float *out, int threads) {
    int64_t row_bytes, row_scales;
    decode_row_fn decode = decoder(format, K, &row_bytes, &row_scales);
    if (decode == NULL || K % BLOCK != 0) return -1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) decode(data + n * row_bytes, scales + n * row_scales, out + n * K, K);
    return 0;
}
