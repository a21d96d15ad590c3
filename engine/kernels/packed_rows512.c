/*
 * The register paths of the packed-weight product with AVX-512 (module doc
 * of packed_linear.c, "Wider registers"): Q4_1, Q8_0 and one-row bfloat16,
 * two strips in one 16-wide register. packed_rows.c walks the blocks and
 * calls these; the other formats take its 8-wide code in every build.
 *
 * Contract: each lane does what packed_rows.c's 8-wide code does for its
 * row (the same decode as packed_columns.h and the same chain of fused
 * multiply-adds in ascending k), so the bits are those of a build without
 * AVX-512.
 */
#include <stdint.h>

#include "packed.h"

#ifdef METRALE_AVX512
/* The register paths again with AVX-512 (module doc, "Wider registers"):
 * column k of strips s and s + 1 decoded into one 16-wide register, strip s
 * in lanes 0-7, by the same arithmetic per lane as q4_1_column and
 * q8_0_column. A pair's bytes lie one strip block apart. */
static inline __attribute__((always_inline)) __m128i pair_bytes(const uint8_t *first, int64_t apart) {
    return _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)first), _mm_loadl_epi64((const __m128i *)(first + apart)));
}

/* Q4_1's d and m of a pair from its two strips' scales, d[8] m[8] each. */
static inline __attribute__((always_inline)) void q4_1_pair_scales(const float *sc, __m512 *d, __m512 *m) {
    const __m512 a = _mm512_loadu_ps(sc), b = _mm512_loadu_ps(sc + 2 * LANES);
    *d = _mm512_shuffle_f32x4(a, b, 0x44); /* a's d, b's d */
    *m = _mm512_shuffle_f32x4(a, b, 0xEE); /* a's m, b's m */
}

static inline __attribute__((always_inline)) __m512 q4_1_pair_column(
    const uint8_t *bytes, __m512 d, __m512 m, int high, int j) {
    __m512i q = _mm512_cvtepu8_epi32(pair_bytes(bytes + 8 * j, LANES * BLOCK / 2));
    q = high ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(q), d), m);
}

/* Q8_0's d of a pair is its two strips' d[8], side by side already. */
static inline __attribute__((always_inline)) __m512 q8_0_pair_column(const uint8_t *bytes, __m512 d, int k) {
    const __m512i q = _mm512_cvtepi8_epi32(pair_bytes(bytes + 8 * k, LANES * BLOCK));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), d);
}

#define PAIRS(op) op(0) op(1) op(2) op(3)
#define PACC_DECLARE(p) __m512 acc##p = _mm512_setzero_ps();
#define PACC_OUT(p) _mm512_storeu_ps(out + (p) * 2 * LANES, acc##p);

/* One row, a group's 8 strips as 4 pairs: row_group_q4_1 and the others. */
static void row_group_q4_1_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK / 2);
        const float *sc = scales + b * GROUP * 2 * LANES;
#define Q4_SCALES(p) __m512 d##p, m##p; q4_1_pair_scales(sc + (p) * 4 * LANES, &d##p, &m##p);
#define Q4_STEP(p) acc##p = _mm512_fmadd_ps(xk, q4_1_pair_column(bytes + (p) * LANES * BLOCK, d##p, m##p, high, j), acc##p);
        PAIRS(Q4_SCALES)
        for (int high = 0; high < 2; high++)
            for (int j = 0; j < BLOCK / 2; j++) {
                const __m512 xk = _mm512_set1_ps(x[16 * high + j]);
                PAIRS(Q4_STEP)
            }
#undef Q4_SCALES
#undef Q4_STEP
    }
    PAIRS(PACC_OUT)
}

static void row_group_q8_0_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *bytes = data + b * GROUP * (LANES * BLOCK);
        const float *sc = scales + b * GROUP * LANES;
#define Q8_SCALES(p) const __m512 d##p = _mm512_loadu_ps(sc + (p) * 2 * LANES);
#define Q8_STEP(p) acc##p = _mm512_fmadd_ps(xk, q8_0_pair_column(bytes + (p) * 2 * LANES * BLOCK, d##p, k), acc##p);
        PAIRS(Q8_SCALES)
        for (int k = 0; k < BLOCK; k++) {
            const __m512 xk = _mm512_set1_ps(x[k]);
            PAIRS(Q8_STEP)
        }
#undef Q8_SCALES
#undef Q8_STEP
    }
    PAIRS(PACC_OUT)
}

static void row_group_bf16_pairs(const float *x, int64_t blocks, const uint8_t *data, const float *scales, float *out) {
    (void)scales;
    PAIRS(PACC_DECLARE)
    for (int64_t b = 0; b < blocks; b++, x += BLOCK) {
        const uint8_t *halves = data + b * GROUP * (2 * LANES * BLOCK);
#define BF16_STEP(p)                                                                                       \
    {                                                                                                      \
        const uint8_t *at = halves + (p) * 4 * LANES * BLOCK + 16 * k;                                     \
        const __m256i h = _mm256_inserti128_si256(                                                         \
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)at)),                                  \
            _mm_loadu_si128((const __m128i *)(at + 2 * LANES * BLOCK)), 1);                                \
        const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));             \
        acc##p = _mm512_fmadd_ps(xk, w, acc##p);                                                           \
    }
        for (int k = 0; k < BLOCK; k++) {
            const __m512 xk = _mm512_set1_ps(x[k]);
            PAIRS(BF16_STEP)
        }
#undef BF16_STEP
    }
    PAIRS(PACC_OUT)
}
#undef PACC_DECLARE
#undef PACC_OUT

/* Two to eight rows x D strip pairs: rows_q4_1 and rows_q8_0 with 16-wide
 * registers. D is 4 (the whole group) up to 3 rows and 2 beyond: the
 * accumulators, a pair's scales and weight vector each and the broadcast
 * within the 32 registers. */
#define RZ_EACH(op) \
    op(0, 0) op(0, 1) op(0, 2) op(0, 3) op(1, 0) op(1, 1) op(1, 2) op(1, 3) \
    op(2, 0) op(2, 1) op(2, 2) op(2, 3) op(3, 0) op(3, 1) op(4, 0) op(4, 1) \
    op(5, 0) op(5, 1) op(6, 0) op(6, 1) op(7, 0) op(7, 1)
#define RZ_ON(r, p) (R > (r) && D > (p) && ((r) < 3 || (p) < 2))
#define RZ_LOAD(r, p) \
    __m512 acc##r##p = RZ_ON(r, p) ? _mm512_loadu_ps(acc + (r) * COLS + (p) * 2 * LANES) : _mm512_setzero_ps();
#define RZ_STORE(r, p) \
    if (RZ_ON(r, p)) _mm512_storeu_ps(acc + (r) * COLS + (p) * 2 * LANES, acc##r##p);
#define RZ_FMA(r, p) \
    if (RZ_ON(r, p)) acc##r##p = _mm512_fmadd_ps(_mm512_set1_ps(x[(r) * K + k]), w##p, acc##r##p);

static inline __attribute__((always_inline)) void rows_q4_1_pairs(
    const int R, const int D, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RZ_EACH(RZ_LOAD)
    __m512 d0 = _mm512_setzero_ps(), m0 = d0, d1 = d0, m1 = d0, d2 = d0, m2 = d0, d3 = d0, m3 = d0;
#define Q4_SCALES(p) if (D > (p)) q4_1_pair_scales(sc + (p) * 4 * LANES, &d##p, &m##p);
#define Q4_W(p) const __m512 w##p = D > (p) ? q4_1_pair_column(bytes + (p) * LANES * BLOCK, d##p, m##p, high, j) : _mm512_setzero_ps();
    PAIRS(Q4_SCALES)
    for (int high = 0; high < 2; high++)
        for (int j = 0; j < BLOCK / 2; j++) {
            const int k = 16 * high + j;
            PAIRS(Q4_W)
            RZ_EACH(RZ_FMA)
        }
#undef Q4_SCALES
#undef Q4_W
    RZ_EACH(RZ_STORE)
}

static inline __attribute__((always_inline)) void rows_q8_0_pairs(
    const int R, const int D, const float *x, int64_t K, const uint8_t *bytes, const float *sc, float *acc) {
    RZ_EACH(RZ_LOAD)
#define Q8_SCALES(p) const __m512 d##p = D > (p) ? _mm512_loadu_ps(sc + (p) * 2 * LANES) : _mm512_setzero_ps();
#define Q8_W(p) const __m512 w##p = D > (p) ? q8_0_pair_column(bytes + (p) * 2 * LANES * BLOCK, d##p, k) : _mm512_setzero_ps();
    PAIRS(Q8_SCALES)
    for (int k = 0; k < BLOCK; k++) {
        PAIRS(Q8_W)
        RZ_EACH(RZ_FMA)
    }
#undef Q8_SCALES
#undef Q8_W
    RZ_EACH(RZ_STORE)
}
#undef PAIRS
#undef RZ_EACH
#undef RZ_ON
#undef RZ_LOAD
#undef RZ_STORE
#undef RZ_FMA

void run_rows_pairs(int format, int R, int D, const float *x, int64_t K, const uint8_t *bytes,
                           const float *sc, float *acc) {
#define PAIRS_CASE(r, d)                                                          \
    case (r) * 8 + (d):                                                           \
        if (format == FORMAT_Q4_1) rows_q4_1_pairs(r, d, x, K, bytes, sc, acc);   \
        else rows_q8_0_pairs(r, d, x, K, bytes, sc, acc);                         \
        break;
    switch (R * 8 + D) {
        PAIRS_CASE(2, 1) PAIRS_CASE(2, 2) PAIRS_CASE(2, 3) PAIRS_CASE(2, 4)
        PAIRS_CASE(3, 1) PAIRS_CASE(3, 2) PAIRS_CASE(3, 3) PAIRS_CASE(3, 4)
        PAIRS_CASE(4, 1) PAIRS_CASE(4, 2) PAIRS_CASE(5, 1) PAIRS_CASE(5, 2)
        PAIRS_CASE(6, 1) PAIRS_CASE(6, 2) PAIRS_CASE(7, 1) PAIRS_CASE(7, 2)
        PAIRS_CASE(8, 1) PAIRS_CASE(8, 2)
    default: break; /* unreachable: rows_product() asks only for these */
    }
#undef PAIRS_CASE
}

/* The one-row group product of `format` by strip pairs; NULL: none. */
row_group_fn row_group_pairs(int format) {
    switch (format) {
    case FORMAT_Q4_1: return row_group_q4_1_pairs;
    case FORMAT_Q8_0: return row_group_q8_0_pairs;
    case FORMAT_BF16: return row_group_bf16_pairs;
    default: return NULL;
    }
}

/* Whether run_rows_pairs takes `format`. */
int has_rows_pairs(int format) { return format == FORMAT_Q4_1 || format == FORMAT_Q8_0; }
#endif
